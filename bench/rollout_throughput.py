"""Generated tokens/s of the rollout runner vs a naive loop, and vs the machine's batched decode speed.

    python bench/rollout_throughput.py [--tasks 12] [--max-turns 2] [--max-tokens 48] [--threads 2]

Same model (SmolLM2-135M, fp32), env (calculator), tasks, sampling (temperature 1, seeded) and token
budget for both:

- naive: one ``model.generate`` call per episode per turn, episodes one after another;
- runner: ``tracegym.rollout.run_rollouts`` with the hf engine (all waiting episodes in one batch,
  KV cache, finished rows leave the batch), run three times: each turn's prompt prefilled whole
  (``turn_cache_mb=0``, the engine before the turn store); with the turn store but the shared
  prompt prefix's keys/values copied into every row and a cache grown by ``torch.cat`` each step
  (``share_prefix_kv=False, preallocate_kv=False``); and the default engine (prefix held once,
  preallocated cache, turn store).

The ceiling: tokens/s of one batched decode step (batch = the runner's batch size, context = the
mean prompt length seen), measured on this machine. The table prints the ratio runner/naive, the
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

    # -- the runner, without and with the engine's previous-turn KV store ----------------------------
    def run_runner(turn_cache_mb: float, **engine_options) -> dict:
        engine = make_engine("hf", model=model, tokenizer=tokenizer, renderer=renderer, max_batch_size=args.tasks,
                             turn_cache_mb=turn_cache_mb, **engine_options)
        timing = {"generate": 0.0, "prefill": 0.0, "prompts": []}
        real_generate, real_forward = engine.generate, engine._forward

        def timed_generate(prompts, params):
            timing["prompts"].extend(len(p) for p in prompts)
            t = time.perf_counter()
            try:
                return real_generate(prompts, params)
            finally:
                timing["generate"] += time.perf_counter() - t

        def timed_forward(**kw):
            t = time.perf_counter()
            out = real_forward(**kw)
            if kw["input_ids"].shape[1] > 1:
                timing["prefill"] += time.perf_counter() - t
            return out

        engine.generate, engine._forward = timed_generate, timed_forward  # type: ignore[method-assign]
        cfg = RolloutConfig(max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens, temperature=1.0, seed=0,
                            concurrency=args.tasks)
        t0 = time.perf_counter()
        result = asyncio.run(run_rollouts(args.env, tasks, engine, renderer, cfg, progress=False))
        wall = time.perf_counter() - t0
        return {"result": result, "time": wall, "tokens": result.stats.generated_tokens,
                "tps": result.stats.generated_tokens / wall, "prefill_tokens": engine.prefill_tokens,
                "turn_reused": engine.turn_tokens_reused, **timing,
                "completions": [[t.completion_ids for t in traj.turns] for traj in result.trajectories]}

    before = run_runner(0.0)
    rss_after_before = peak_rss_mb()
    copied = run_runner(1024.0, share_prefix_kv=False, preallocate_kv=False)  # the engine of 2026-12-01
    after = run_runner(1024.0)
    rss_after_runner = peak_rss_mb()
    result, runner_time, runner_tokens, runner_tps = after["result"], after["time"], after["tokens"], after["tps"]
    gen_time, prefill_time, prompt_lengths = after["generate"], after["prefill"], after["prompts"]
    same_tokens = before["completions"] == after["completions"] == copied["completions"]

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

    # -- the ceiling: one batched decode step at the runner's batch size and mean context ---------------
    batch = max(1, round(result.stats.mean_batch_size))
    context = int(statistics.mean(prompt_lengths)) if prompt_lengths else 256
    from transformers import DynamicCache

    with torch.inference_mode():
        ids = torch.randint(100, 40000, (batch, context))
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        step_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = 8
        t = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=step_ids, cache=cache, use_cache=True, logits_to_keep=1)
            step_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        decode_tps = batch * steps / (time.perf_counter() - t)
    rss_end = peak_rss_mb()

    other = runner_time - gen_time
    rows = [
        ("naive loop (generate per episode per turn)", naive_tokens, naive_time, naive_tps),
        ("runner, each turn re-prefilled (turn_cache_mb=0)", before["tokens"], before["time"], before["tps"]),
        ("runner, prefix KV copied per row, cat-grown cache", copied["tokens"], copied["time"], copied["tps"]),
        ("tracegym runner (hf engine, turn KV kept)", runner_tokens, runner_time, runner_tps),
        (f"batched decode step, batch {batch}, context {context}", batch * steps, None, decode_tps),
    ]
    print(f"\nrollout throughput: {args.model}, env {args.env}, {args.tasks} tasks, <= {args.max_turns} turns x "
          f"{args.max_tokens} tokens, temperature 1, torch threads {args.threads}")
    print(f"{'':50s} {'tokens':>8s} {'seconds':>9s} {'tok/s':>8s}")
    for name, tokens, secs, tps in rows:
        print(f"{name:50s} {tokens:8d} {secs if secs is not None else float('nan'):9.1f} {tps:8.1f}")
    print(f"\nrunner / naive: {runner_tps / naive_tps:.2f}x   runner / decode ceiling: {runner_tps / decode_tps:.0%}   "
          f"turn KV kept / re-prefilled: {runner_tps / before['tps']:.2f}x   "
          f"shared-prefix KV + preallocated cache / copied: {runner_tps / copied['tps']:.2f}x")
    print(f"prompt tokens computed: {before['prefill_tokens']} re-prefilled vs {after['prefill_tokens']} with the turn "
          f"store ({after['turn_reused']} reused); prefill time {before['prefill']:.1f}s vs {prefill_time:.1f}s; "
          f"same sampled tokens: {same_tokens}")
    print(f"runner time: generate {gen_time:.1f}s ({gen_time / runner_time:.0%}; prefill {prefill_time:.1f}s), "
          f"env + rendering + scheduling {other:.1f}s; {result.stats.generate_calls} generate calls, "
          f"mean batch {result.stats.mean_batch_size:.1f}, end reasons {result.stats.end_reasons}")
    print("limits: the batch shrinking as rows finish (the tail decodes at small batch) and the per-turn barrier "
          "on the slowest row (a finished row is not replaced by a waiting episode within a generate call)")
    print(f"peak RSS: after load {rss_after_load:.0f} MB, after the re-prefill runner {rss_after_before:.0f} MB, "
          f"after the turn-store runner {rss_after_runner:.0f} MB, end {rss_end:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
