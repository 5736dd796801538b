"""Generated tokens/s of the rollout runner vs a naive loop, and vs the machine's batched decode speed.

    python bench/rollout_throughput.py [--tasks 12] [--max-turns 2] [--max-tokens 48] [--threads 2]

Same model (SmolLM2-135M, fp32), env (calculator), tasks, sampling (temperature 1, seeded) and token
budget for both:

- naive: one ``model.generate`` call per episode per turn, episodes one after another;
- runner: ``tracegym.rollout.run_rollouts`` with the hf engine (KV cache, each episode's previous
  turn kept, the shared prompt prefix held once), run twice: ``batching="per_turn"`` (one generate
  call for all waiting episodes, which ends with its slowest row) and ``batching="continuous"`` (the
  default: a turn joins the running batch when it is ready and leaves when it ends). With
  ``--compare-engines`` also the per-turn runner with each turn re-prefilled (``turn_cache_mb=0``)
  and with the prefix copied into every row and a cat-grown cache (the engine of 2026-12-01).

The ceiling: tokens/s of one batched decode step (batch = the continuous runner's mean rows per
decode step, and the full batch; context = the mean prompt length seen), measured on this machine.
It leaves out the prompt tokens every runner must compute (first turns, tool results); the script
prints the bound they set too. The table prints the ratio runner/naive, the
fraction of the ceiling the runner reaches, where the runner's time goes (prefill vs decode vs the
rest) and peak RSS. Default run: about 2-4 minutes on 2 cores. The CPU may be shared: quote numbers
with that caveat.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--env", default="calculator")
    parser.add_argument("--tasks", type=int, default=12)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48, help="max tokens per turn")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--compare-engines", action="store_true",
                        help="also run the per-turn runner with each turn re-prefilled and with the prefix KV copied")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from tracegym.engines import make_engine
    from tracegym.envs import make
    from tracegym.models import load
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig, run_rollouts

    model, tokenizer = load(args.model)
    renderer = get_renderer(args.model, tokenizer)
    stop_ids = list(renderer.stop_token_ids)
    tasks = make(args.env).tasks("train", n=args.tasks, seed=0)
    rss_after_load = peak_rss_mb()

    # -- the runner: per-turn generate calls, and continuous batching ------------------------------
    def run_runner(batching: str, turn_cache_mb: float = 1024.0, **engine_options) -> dict:
        engine = make_engine("hf", model=model, tokenizer=tokenizer, renderer=renderer, max_batch_size=args.tasks,
                             turn_cache_mb=turn_cache_mb, **engine_options)
        timing = {"prefill": 0.0, "decode": 0.0}
        real_forward = engine._forward

        def timed_forward(*a, **kw):
            t = time.perf_counter()
            out = real_forward(*a, **kw)
            timing["prefill" if kw["input_ids"].shape[1] > 1 else "decode"] += time.perf_counter() - t
            return out

        engine._forward = timed_forward  # type: ignore[method-assign]
        cfg = RolloutConfig(max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens, temperature=1.0, seed=0,
                            concurrency=args.tasks, batching=batching)
        t0 = time.perf_counter()
        result = asyncio.run(run_runner_async(cfg, engine))
        wall = time.perf_counter() - t0
        prompts = [len(turn.prompt_ids) for traj in result.trajectories for turn in traj.turns]
        return {"result": result, "time": wall, "tokens": result.stats.generated_tokens,
                "tps": result.stats.generated_tokens / wall, "prefill_tokens": engine.prefill_tokens,
                "turn_reused": engine.turn_tokens_reused, "prompts": prompts, **timing,
                "completions": [[t.completion_ids for t in traj.turns] for traj in result.trajectories]}

    async def run_runner_async(cfg, engine):
        return await run_rollouts(args.env, tasks, engine, renderer, cfg, progress=False)

    runs: dict[str, dict] = {}
    if args.compare_engines:  # the engine's earlier layouts, per-turn calls
        runs["re-prefilled"] = run_runner("per_turn", turn_cache_mb=0.0)
        runs["copied"] = run_runner("per_turn", share_prefix_kv=False, preallocate_kv=False)
    runs["per_turn"] = run_runner("per_turn")
    rss_after_per_turn = peak_rss_mb()
    runs["continuous"] = run_runner("continuous")
    rss_after_runner = peak_rss_mb()
    after = runs["continuous"]
    result, runner_tps = after["result"], after["tps"]
    prompt_lengths = after["prompts"]

    # -- the naive loop --------------------------------------------------------------------------------
    naive_tokens, naive_time = 0, 0.0
    if not args.skip_naive:
        torch.manual_seed(0)

        async def naive() -> int:
            total = 0
            for task in tasks:
                env = make(args.env)
                messages = list(await env.reset(task))
                tools = env.tool_schemas()
                prompt = renderer.render_prompt(messages, tools)
                for _ in range(args.max_turns):
                    ids = torch.tensor([prompt])
                    with torch.inference_mode():
                        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                             top_p=1.0, top_k=0, max_new_tokens=args.max_tokens, eos_token_id=stop_ids,
                                             pad_token_id=tokenizer.pad_token_id)
                    completion = out[0, len(prompt):].tolist()
                    total += len(completion)
                    parsed = renderer.parse_completion(completion)
                    step = await env.step(parsed.message, parsed.errors)
                    if step.terminated or step.truncated:
                        break
                    prompt = renderer.continue_prompt(prompt, completion, step.messages)
            return total

        t0 = time.perf_counter()
        naive_tokens = asyncio.run(naive())
        naive_time = time.perf_counter() - t0
    naive_tps = naive_tokens / naive_time if naive_time else float("nan")

    # -- the ceiling: one batched decode step at the runner's mean batch and context ---------------------
    from transformers import DynamicCache

    def decode_tps(batch: int, context: int, steps: int = 8) -> float:
        with torch.inference_mode():
            ids = torch.randint(100, 40000, (batch, context))
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            step_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            t = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=step_ids, cache=cache, use_cache=True, logits_to_keep=1)
                step_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            return batch * steps / (time.perf_counter() - t)

    batch = max(1, round(result.stats.mean_batch_size))
    context = int(statistics.mean(prompt_lengths)) if prompt_lengths else 256
    ceiling = decode_tps(batch, context)
    full_batch_ceiling = decode_tps(args.tasks, context)
    rss_end = peak_rss_mb()

    labels = {
        "re-prefilled": "runner, per-turn calls, each turn re-prefilled",
        "copied": "runner, per-turn calls, prefix KV copied per row",
        "per_turn": "runner, per-turn generate calls (batching: per_turn)",
        "continuous": "tracegym runner, continuous batching (default)",
    }
    rows = [("naive loop (generate per episode per turn)", naive_tokens, naive_time, naive_tps)]
    rows += [(labels[name], run["tokens"], run["time"], run["tps"]) for name, run in runs.items()]
    rows += [(f"batched decode step, batch {batch}, context {context}", batch * 8, None, ceiling),
             (f"batched decode step, batch {args.tasks}, context {context}", args.tasks * 8, None, full_batch_ceiling)]
    print(f"\nrollout throughput: {args.model}, env {args.env}, {args.tasks} tasks, <= {args.max_turns} turns x "
          f"{args.max_tokens} tokens, temperature 1, torch threads {args.threads}")
    print(f"{'':56s} {'tokens':>8s} {'seconds':>9s} {'tok/s':>8s}")
    for name, tokens, secs, tps in rows:
        print(f"{name:56s} {tokens:8d} {secs if secs is not None else float('nan'):9.1f} {tps:8.1f}")
    per_turn = runs["per_turn"]
    print(f"\nrunner / naive: {runner_tps / naive_tps:.2f}x   runner / decode ceiling (batch {batch}): "
          f"{runner_tps / ceiling:.0%}   continuous / per-turn: {runner_tps / per_turn['tps']:.2f}x")
    print(f"{'':14s}{'wall s':>8s} {'prefill s':>10s} {'decode s':>9s} {'other s':>8s} {'prompt tok computed':>20s} "
          f"{'mean batch':>11s} {'calls':>6s}")
    for name, run in runs.items():
        stats = run["result"].stats
        other = run["time"] - run["prefill"] - run["decode"]
        print(f"{name:14s}{run['time']:8.1f} {run['prefill']:10.1f} {run['decode']:9.1f} {other:8.1f} "
              f"{run['prefill_tokens']:20d} {stats.mean_batch_size:11.1f} {stats.generate_calls:6d}")
    # what the decode ceiling leaves out: the prompt tokens every runner must compute (first turns, tool results)
    decode_only = after["tokens"] / ceiling
    print(f"decode of the sampled tokens at the ceiling: {decode_only:.1f}s; the continuous runner's prefill of "
          f"{after['prefill_tokens']} prompt tokens took {after['prefill']:.1f}s; bound with that prefill: "
          f"{after['tokens'] / (decode_only + after['prefill']):.1f} tok/s = "
          f"{after['tokens'] / (decode_only + after['prefill']) / ceiling:.0%} of the ceiling")
    same = [a == b for a, b in zip(runs["per_turn"]["completions"], after["completions"])]
    print(f"end reasons: {result.stats.end_reasons}; mean prompt {context} tokens (the two batchings seed each "
          f"turn differently, so their samples differ: {sum(same)}/{len(same)} episodes equal)")
    print(f"peak RSS: after load {rss_after_load:.0f} MB, after the per-turn runner {rss_after_per_turn:.0f} MB, "
          f"after the continuous runner {rss_after_runner:.0f} MB, end {rss_end:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
