"""GPU CHECK (needs a CUDA GPU and ``pip install tracegym[gpu]``; not part of the CPU test suite).

    python bench/gpu_vllm_check.py [--prompts 32] [--n 4] [--max-tokens 128]

1. Loads SmolLM2-135M-Instruct through ``tracegym.models`` (the de-quantised cache folder) and builds
   calculator prompts with the SmolLM2 renderer.
2. Samples through the vllm engine (token-id prompts, temperature 1, top-p 0.95, log-prob of each
   sampled token) and prints the throughput.
3. Re-scores every sampled token with a teacher-forced HF forward pass (fp32, on the GPU, same
   temperature/top-p transform) and prints mean/max |delta log-prob| (expect ~1e-3..1e-2 with vLLM's
   bf16/fp16 kernels; a gap near 1 means the log-probs are from another distribution).
4. Weight sync: perturbs the HF model, sends it with ``update_weights`` and checks greedy outputs
   change and match the perturbed HF model's greedy tokens on most prompts; then sends a peft
   model with a LoRA adapter (merged on the way, ``merged_state_dict``) and checks that the
   trainer's frozen weights are bit-identical afterwards and vLLM's greedy tokens match its own.
5. An RL run with ``rollout.engine: vllm`` (LoRA hot-swapped into vLLM under a new versioned name
   after every update): ``--rl-steps`` steps of GRPO on one-call calculator problems, printing
   seconds per step, the engine/trainer log-prob gap the recipe measures, and the reward.
Exit code 0 when the gap, the weight-sync checks and the RL run pass. The whole script stays
under 10 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="vLLM dtype (float32 makes the gap smallest)")
    parser.add_argument("--max-mean-gap", type=float, default=0.05)
    parser.add_argument("--rl-steps", type=int, default=3, help="steps of the vLLM-sampled RL run (0: skip)")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: this is a GPU check")
        return 2
    from tracegym.engines.sampling import sampling_logprobs
    from tracegym.engines import make_engine
    from tracegym.envs import make
    from tracegym.models import build_smollm2_cache, load
    from tracegym.render import get_renderer
    from tracegym.types import SamplingParams

    model, tokenizer = load("smollm2-135m")
    folder = build_smollm2_cache()
    renderer = get_renderer("smollm2-135m", tokenizer)
    env = make("calculator")
    import asyncio

    prompts = []
    for task in env.tasks("train", n=args.prompts, seed=0):
        messages = asyncio.run(env.reset(task))
        prompts.append(renderer.render_prompt(messages, env.tool_schemas()))

    engine = make_engine("vllm", model=str(folder), renderer=renderer, dtype=args.dtype,
                         gpu_memory_utilization=0.3, max_model_len=2048)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=args.max_tokens, n=args.n, seed=0)
    engine.generate(prompts[:2], params)  # warm-up (CUDA graphs, allocator)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    secs = time.perf_counter() - t
    tokens = sum(len(g.token_ids) for gs in outs for g in gs)
    print(f"vllm: {len(prompts)} prompts x {args.n} samples, {tokens} tokens in {secs:.2f}s = {tokens / secs:.0f} tok/s")

    hf = model.to("cuda").eval()
    diffs = []
    with torch.inference_mode():
        for prompt, gens in zip(prompts, outs):
            for g in gens:
                if not g.token_ids:
                    continue
                ids = torch.tensor([prompt + list(g.token_ids)], device="cuda")
                logits = hf(input_ids=ids, logits_to_keep=len(g.token_ids) + 1).logits[0, :-1]
                lp = sampling_logprobs(logits, params.temperature, params.top_p)
                scored = lp.gather(-1, torch.tensor(g.token_ids, device="cuda")[:, None]).squeeze(-1).double().cpu()
                diffs.append((scored - torch.tensor(g.logprobs, dtype=torch.float64)).abs())
    gap = torch.cat(diffs)
    finite = gap[torch.isfinite(gap)]
    print(f"log-prob gap vllm vs teacher-forced HF over {gap.numel()} tokens: mean {finite.mean():.3e} "
          f"max {finite.max():.3e} (non-finite: {(~torch.isfinite(gap)).sum().item()}, tokens outside HF's nucleus)")

    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    before = engine.generate(prompts[:8], greedy)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    engine.update_weights(hf.state_dict())
    after = engine.generate(prompts[:8], greedy)
    changed = sum(a[0].token_ids != b[0].token_ids for a, b in zip(after, before))
    agree = 0
    with torch.inference_mode():
        for prompt, [g] in zip(prompts[:8], after):
            ids = torch.tensor([prompt], device="cuda")
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              eos_token_id=list(renderer.stop_token_ids), pad_token_id=0)[0, len(prompt):].tolist()
            agree += ref[:4] == list(g.token_ids[:4])
    print(f"weight sync: greedy outputs changed on {changed}/8 prompts; first 4 tokens match the updated HF model on {agree}/8")
    ok = float(finite.mean()) < args.max_mean_gap and changed >= 4 and agree >= 6
    ok = merged_lora_sync(engine, hf, prompts[:8], renderer) and ok
    engine.close()
    del engine
    if args.rl_steps:
        ok = rl_with_vllm(args.rl_steps, args.max_mean_gap) and ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def merged_lora_sync(engine, hf, prompts, renderer) -> bool:
    """4b. A peft model sent whole (``update_weights``, no ``enable_lora``): vLLM gets the merge
    (``merged_state_dict``), and the trainer's frozen weights stay bit for bit what they were."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tracegym.types import SamplingParams

    policy = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    frozen = {k: v.clone() for k, v in policy.state_dict().items() if "base_layer" in k}
    engine.update_weights(policy)
    untouched = all(torch.equal(frozen[k], v) for k, v in policy.state_dict().items() if k in frozen)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    out = engine.generate(prompts, greedy)
    agree = 0
    with torch.inference_mode():
        for prompt, [g] in zip(prompts, out):
            ids = torch.tensor([prompt], device="cuda")
            ref = policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                  eos_token_id=list(renderer.stop_token_ids), pad_token_id=0)[0, len(prompt):].tolist()
            agree += ref[:4] == list(g.token_ids[:4])
    print(f"merged LoRA sync: trainer's frozen weights bit-identical: {untouched}; first 4 tokens match the peft "
          f"model on {agree}/{len(prompts)}")
    return untouched and agree >= 6


def rl_with_vllm(steps: int, max_gap: float) -> bool:
    """``tracegym rl`` sampling with vLLM: LoRA updates reach the engine as versioned adapters."""
    import tempfile

    from tracegym.config import RLConfig, load_config
    from tracegym.recipes.rl import train_rl
    from tracegym.train.logging import read_metrics

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(RLConfig, data={
            "model": {"name": "smollm2-135m"}, "lora": {"enabled": True, "r": 16},
            "env": {"name": "calculator", "options": {"num_calls": 1}}, "tasks": {"train": 64, "test": 0},
            "tasks_per_step": 8, "group_size": 8, "steps": steps, "skip_uniform_groups": False,
            "rollout": {"engine": "vllm", "engine_options": {"enable_lora": True, "gpu_memory_utilization": 0.3,
                                                             "max_model_len": 2048},
                        "max_turns": 4, "max_tokens_per_turn": 64, "temperature": 1.0, "measure_logprob_gap": True},
            "eval": {"every": 0, "at_start": False}, "output_dir": out,
            "logging": {"progress": False, "tensorboard": False},
        })
        t = time.perf_counter()
        train_rl(cfg)
        rows = [r for r in read_metrics(out) if r["step"] > 0]
    secs = (time.perf_counter() - t) / max(1, len(rows))
    gaps = [r["logprob_gap/mean"] for r in rows if "logprob_gap/mean" in r]
    print(f"rl with vllm: {len(rows)} steps, {secs:.1f} s/step, rewards {[round(r['reward/mean'], 3) for r in rows]}, "
          f"log-prob gap means {[f'{g:.2e}' for g in gaps]}")
    return len(rows) == steps and (not gaps or max(gaps) < max_gap)


if __name__ == "__main__":
    sys.exit(main())
