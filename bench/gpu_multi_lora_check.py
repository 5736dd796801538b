"""GPU CHECK: a team of LoRA adapters on one base model in one vLLM engine (needs a CUDA GPU and
``pip install tracegym[gpu]``; not part of the CPU test suite). About 2-4 minutes on one H200.

    python bench/gpu_multi_lora_check.py [--prompts 24] [--n 2] [--max-tokens 48] [--dtype float16]

What it checks (each step prints a line or a table; the last line is PASS or FAIL):

1. Loads SmolLM2-135M-Instruct through ``tracegym.models`` (the HF model, the reference, in fp32 on
   the GPU; the de-quantised cache folder for vLLM) and wraps it with peft: two LoRA adapters,
   ``planner`` and ``solver`` (r=8, all linear projections), each with its own random init. Their
   size is calibrated on the HF model so that each moves the prompt tokens' log-probs by about
   0.3-1.5 nats from the base model: far enough apart to tell which weights served a row.
2. Builds ``VLLMEngine(enable_lora=True, max_loras=4)`` and sends both adapters with
   ``update_weights(peft_model)`` (each saved with ``save_pretrained(selected_adapters=[name])``).
3. Samples one mixed batch (``adapters`` cycling planner, solver, ``__base__``; temperature 1, top-p 1,
   ``n`` samples per prompt) in one ``generate`` call, then re-scores every sampled token with a
   teacher-forced HF forward pass under each reference (peft ``set_adapter``; ``disable_adapter`` for
   the base) and prints the mean |delta log-prob| table: rows = the adapter vLLM served, columns =
   the HF reference. PASS needs each row's own column below ``--max-gap`` (same distribution, up to
   vLLM's fp16/bf16 kernels: expect ~1e-3..2e-2) and at least ``--separation`` times smaller than the
   other columns (the row was served with its own adapter, not another one or none).
4. Hot swap: keeps a copy of the planner as ``planner_old``, re-draws the planner's weights, sends it
   with ``update_adapter("planner", peft_model)`` (a new LoRARequest id and name; the old id removed)
   and samples the same batch again. PASS needs planner rows to match the NEW planner (and be far from
   the old one: no stale adapter, no stale prefix cache), solver and base rows to still match theirs,
   greedy outputs of planner rows to change on at least half of the prompts and those of solver and
   base rows to stay the same (one row in ten, at least one, may flip on a near-tie: fp16 kernels and
   another batch shape).
5. Prints the time of each phase, the peak GPU memory of this process (vLLM runs in it) and the GPU
   memory in use.

Exit code: 0 PASS, 1 FAIL, 2 no GPU or no vLLM. ``--dtype float32`` is not offered: vLLM's LoRA
kernels take fp16/bf16 only (vllm-project/vllm#10348, #14827).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROLES = ("planner", "solver")
BASE = "__base__"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
USER_MESSAGES = [
    "What is 17 times 23?", "Name three prime numbers above 50.", "Write a haiku about the sea.",
    "Explain recursion in one sentence.", "Plan a three-step route from Paris to Rome.",
    "Solve for x: 3x + 5 = 20.", "Give a synonym for 'quick'.", "What is the capital of Canada?",
    "List the steps to boil an egg.", "Translate 'good morning' into French.",
    "Summarise the water cycle.", "How many minutes are in a day?",
]


# --- the peft team -----------------------------------------------------------------------------------


def make_team(model: Any, rank: int, seed: int) -> Any:
    """``model`` wrapped by peft with one LoRA adapter per role, each drawn from its own seed."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0, bias="none")
    team = get_peft_model(model, config, adapter_name=ROLES[0])
    for role in ROLES[1:]:
        team.add_adapter(role, config)
    for k, role in enumerate(ROLES):
        redraw(team, role, seed + 1000 * k, std=0.02)
    team.set_adapter(ROLES[0])
    return team.eval()


def lora_params(team: Any, name: str) -> list[tuple[str, Any]]:
    return [(n, p) for n, p in team.named_parameters() if f".lora_A.{name}." in n or f".lora_B.{name}." in n]


def redraw(team: Any, name: str, seed: int, std: float) -> None:
    """New random factors for adapter ``name``: A uniform in +-1/sqrt(fan_in) (peft's scale), B normal
    with ``std`` (``scale_b`` changes it later: a B of zeros, peft's default, would be no adapter)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for pname, p in lora_params(team, name):
            if ".lora_A." in pname:
                bound = 1.0 / p.shape[1] ** 0.5
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def scale_b(team: Any, name: str, factor: float) -> None:
    import torch

    with torch.no_grad():
        for pname, p in lora_params(team, name):
            if ".lora_B." in pname:
                p.mul_(factor)


def copy_adapter(team: Any, src: str, dst: str) -> None:
    """Add adapter ``dst`` to the team holding ``src``'s current weights (a frozen copy)."""
    import torch

    team.add_adapter(dst, team.peft_config[src])
    dst_params = dict(lora_params(team, dst))
    with torch.no_grad():
        for pname, p in lora_params(team, src):
            dst_params[pname.replace(f".{src}.", f".{dst}.")].copy_(p)


def token_logprobs(team: Any, reference: str, prompt: Sequence[int], tokens: Sequence[int],
                   temperature: float, top_p: float, device: str) -> Any:
    """Log-probs of ``tokens`` after ``prompt`` under the sampling distribution of ``reference``
    (an adapter name, or ``__base__``), teacher-forced, in fp32."""
    import contextlib

    import torch

    from tracegym.engines.sampling import sampling_logprobs

    ids = torch.tensor([list(prompt) + list(tokens)], device=device)
    if reference == BASE:
        ctx: Any = team.disable_adapter()
    else:
        team.set_adapter(reference)
        ctx = contextlib.nullcontext()
    with ctx, torch.inference_mode():
        logits = team(input_ids=ids).logits[0, len(prompt) - 1: -1]
    lp = sampling_logprobs(logits, temperature, top_p)
    return lp.gather(-1, torch.tensor(list(tokens), device=device)[:, None]).squeeze(-1).double().cpu()


def prompt_shift(team: Any, name: str, prompts: Sequence[Sequence[int]], device: str) -> float:
    """Mean |log p_adapter - log p_base| of each prompt's own next tokens (how far ``name`` is from
    the base model)."""
    diffs = []
    for prompt in prompts:
        a = token_logprobs(team, name, prompt[:1], prompt[1:], 1.0, 1.0, device)
        b = token_logprobs(team, BASE, prompt[:1], prompt[1:], 1.0, 1.0, device)
        diffs.append((a - b).abs().mean().item())
    return sum(diffs) / len(diffs)


def calibrate(team: Any, name: str, prompts: Sequence[Sequence[int]], device: str,
              low: float = 0.3, high: float = 1.5) -> tuple[float, float]:
    """Scale adapter ``name``'s B factors until its prompt shift is in [low, high]; returns
    (total scale applied, shift)."""
    total, shift = 1.0, prompt_shift(team, name, prompts, device)
    for _ in range(12):
        if low <= shift <= high:
            break
        factor = 0.5 if shift > high else 2.0
        scale_b(team, name, factor)
        total *= factor
        shift = prompt_shift(team, name, prompts, device)
    return total, shift


# --- the check ---------------------------------------------------------------------------------------


def gap_table(team: Any, prompts: Sequence[Sequence[int]], adapters: Sequence[str], outs: Any,
              references: Sequence[str], temperature: float, top_p: float, device: str) -> dict[str, dict[str, float]]:
    """{served adapter: {reference: mean |vLLM log-prob - HF log-prob|}} over all sampled tokens."""
    import torch

    sums: dict[str, dict[str, list[Any]]] = {}
    for prompt, served, gens in zip(prompts, adapters, outs):
        for g in gens:
            if not g.token_ids:
                continue
            vllm_lp = torch.tensor(g.logprobs, dtype=torch.float64)
            for ref in references:
                hf_lp = token_logprobs(team, ref, prompt, g.token_ids, temperature, top_p, device)
                sums.setdefault(served, {}).setdefault(ref, []).append((hf_lp - vllm_lp).abs())
    table: dict[str, dict[str, float]] = {}
    for served, per_ref in sums.items():
        table[served] = {}
        for ref, parts in per_ref.items():
            gap = torch.cat(parts)
            finite = gap[torch.isfinite(gap)]
            table[served][ref] = float(finite.mean()) if finite.numel() else float("inf")
    return table


def print_table(title: str, table: dict[str, dict[str, float]], references: Sequence[str],
                own: dict[str, str]) -> None:
    width = max(12, *(len(r) + 2 for r in references))
    print(f"\n{title}: mean |delta log-prob| vLLM vs teacher-forced HF (rows: adapter vLLM served; "
          "columns: HF reference; * the row's own adapter)")
    print("served".ljust(12) + "".join(r.rjust(width) for r in references))
    for served in table:
        cells = []
        for ref in references:
            mark = "*" if own.get(served) == ref else " "
            cells.append(f"{table[served].get(ref, float('nan')):.2e}{mark}".rjust(width))
        print(served.ljust(12) + "".join(cells))


def judge(table: dict[str, dict[str, float]], own: dict[str, str], max_gap: float, separation: float,
          failures: list[str], phase: str) -> None:
    for served, ref in own.items():
        row = table.get(served)
        if not row:
            failures.append(f"{phase}: no tokens sampled for {served} rows")
            continue
        if not row[ref] < max_gap:
            failures.append(f"{phase}: {served} rows are {row[ref]:.2e} from HF {ref} (max {max_gap})")
        others = {r: v for r, v in row.items() if r != ref}
        closest = min(others, key=lambda r: others[r])
        if not row[ref] * separation < others[closest]:
            failures.append(f"{phase}: {served} rows are not clearly {ref}: {row[ref]:.2e} from it, "
                            f"{others[closest]:.2e} from {closest} (need x{separation})")


def greedy_tokens(engine: Any, prompts: Sequence[Sequence[int]], adapters: Sequence[str], max_tokens: int) -> list:
    from tracegym.types import SamplingParams

    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), adapters=adapters)
    return [row[0].token_ids for row in outs]


def run_check(engine: Any, team: Any, prompts: Sequence[Sequence[int]], args: Any, device: str,
              clock: Callable[[str], None]) -> list[str]:
    """Steps 2-4 of the module docstring on a built engine; returns the failures (empty: PASS)."""
    from tracegym.types import SamplingParams

    failures: list[str] = []
    engine.update_weights(team)  # every adapter of the peft model, each as a new LoRARequest
    requests = dict(engine.adapter_requests)
    print("adapters in vLLM: " + ", ".join(f"{n} -> {r.lora_name} (id {r.lora_int_id}) {r.lora_path}"
                                          for n, r in requests.items()))
    if sorted(requests) != sorted(ROLES):
        failures.append(f"update_weights sent adapters {sorted(requests)}, expected {sorted(ROLES)}")
        return failures
    cycle = [*ROLES, BASE]
    adapters = [cycle[i % len(cycle)] for i in range(len(prompts))]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, n=args.n, seed=args.seed)
    engine.generate(prompts[:3], params, adapters=adapters[:3])  # warm-up: loads the adapters, allocator
    clock("warm-up")

    t = time.perf_counter()
    outs = engine.generate(prompts, params, adapters=adapters)
    secs = time.perf_counter() - t
    tokens = sum(len(g.token_ids) for row in outs for g in row)
    print(f"mixed batch: {len(prompts)} prompts x {args.n} ({adapters.count('planner')} planner, "
          f"{adapters.count('solver')} solver, {adapters.count(BASE)} base) = {tokens} tokens in one "
          f"generate call, {secs:.2f}s ({tokens / max(secs, 1e-9):.0f} tok/s)")
    references = [*ROLES, BASE]
    own = {r: r for r in references}
    table = gap_table(team, prompts, adapters, outs, references, params.temperature, params.top_p, device)
    print_table("before the hot swap", table, references, own)
    judge(table, own, args.max_gap, args.separation, failures, "before the hot swap")
    clock("mixed batch + HF scoring")

    greedy_before = greedy_tokens(engine, prompts, adapters, args.greedy_tokens)
    old = engine.adapter_requests["planner"]
    copy_adapter(team, "planner", "planner_old")
    redraw(team, "planner", args.seed + 777, std=0.02)
    scale, shift = calibrate(team, "planner", prompts[:4], device)
    print(f"\nhot swap: planner re-drawn (B scale {scale:g}, prompt shift from base {shift:.2f} nats)")
    t = time.perf_counter()
    new = engine.update_adapter("planner", team)
    print(f"update_adapter('planner') in {time.perf_counter() - t:.2f}s: {old.lora_name} (id {old.lora_int_id}) -> "
          f"{new.lora_name} (id {new.lora_int_id})")
    if new.lora_int_id == old.lora_int_id or new.lora_name == old.lora_name:
        failures.append("the hot swap reused the old LoRARequest id or name")
    if engine.adapter_requests["solver"] is not requests["solver"]:
        failures.append("updating the planner changed the solver's LoRARequest")
    list_loras = getattr(getattr(getattr(engine, "llm", None), "llm_engine", None), "list_loras", None)
    if list_loras is not None:
        loaded = set(list_loras())
        print(f"LoRA ids loaded in vLLM after the swap: {sorted(loaded)}")
        if old.lora_int_id in loaded:
            failures.append(f"the old planner id {old.lora_int_id} is still loaded in vLLM after the swap")

    outs = engine.generate(prompts, params, adapters=adapters)
    references = ["planner", "planner_old", "solver", BASE]
    table = gap_table(team, prompts, adapters, outs, references, params.temperature, params.top_p, device)
    print_table("after the hot swap", table, references, own)
    judge(table, own, args.max_gap, args.separation, failures, "after the hot swap")
    planner_row = table.get("planner", {})
    if planner_row and not planner_row["planner"] * args.separation < planner_row["planner_old"]:
        failures.append("after the hot swap planner rows are not clearly the new planner (stale weights?)")

    greedy_after = greedy_tokens(engine, prompts, adapters, args.greedy_tokens)
    for name in (*ROLES, BASE):
        rows = [i for i, a in enumerate(adapters) if a == name]
        same = sum(greedy_before[i] == greedy_after[i] for i in rows)
        print(f"greedy {args.greedy_tokens} tokens, {name} rows: {len(rows) - same}/{len(rows)} changed by the swap")
        if name == "planner" and (len(rows) - same) * 2 < len(rows):
            failures.append(f"planner greedy outputs changed on only {len(rows) - same}/{len(rows)} prompts")
        if name != "planner" and len(rows) - same > max(1, len(rows) // 10):
            failures.append(f"{name} greedy outputs changed on {len(rows) - same}/{len(rows)} prompts (should not)")
    clock("hot swap + checks")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24, help="prompts in the mixed batch (a multiple of 3 is even)")
    parser.add_argument("--n", type=int, default=2, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--greedy-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                        help="vLLM dtype (float16 makes the gap smaller; LoRA kernels take no float32)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-gap", type=float, default=0.05, help="largest mean gap to the row's own adapter")
    parser.add_argument("--separation", type=float, default=3.0,
                        help="the own adapter's gap must be this many times smaller than any other's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start, slower sampling)")
    args = parser.parse_args()

    start = time.perf_counter()
    last = [start]

    def clock(what: str) -> None:
        now = time.perf_counter()
        print(f"[{now - start:6.1f}s] {what} ({now - last[0]:.1f}s)")
        last[0] = now

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: this is a GPU check")
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"no vLLM ({exc}): pip install tracegym[gpu]")
        return 2
    from tracegym.engines import make_engine
    from tracegym.models import build_smollm2_cache, load
    from tracegym.render import get_renderer
    from tracegym.types import Message

    device = "cuda"
    model, tokenizer = load("smollm2-135m")
    folder = build_smollm2_cache()
    renderer = get_renderer("smollm2-135m", tokenizer)
    prompts = [renderer.render_prompt([Message(role="user", content=USER_MESSAGES[i % len(USER_MESSAGES)]
                                               + ("" if i < len(USER_MESSAGES) else f" (variant {i})"))])
               for i in range(args.prompts)]
    team = make_team(model.to(device), args.rank, args.seed)
    for role in ROLES:
        scale, shift = calibrate(team, role, prompts[:4], device)
        print(f"adapter {role}: r={args.rank}, B scale {scale:g}, prompt shift from base {shift:.2f} nats")
    clock("HF model and peft team")

    engine = make_engine("vllm", model=str(folder), renderer=renderer, dtype=args.dtype, enable_lora=True,
                         max_loras=4, max_lora_rank=max(16, args.rank),
                         gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=1024,
                         enforce_eager=args.enforce_eager, seed=args.seed)
    clock(f"vLLM engine (dtype {args.dtype}, max_loras 4)")
    try:
        failures = run_check(engine, team, prompts, args, device, clock)
    finally:
        engine.close()

    peak = torch.cuda.max_memory_allocated() / 2**30
    free, total = torch.cuda.mem_get_info()
    print(f"\nGPU memory: peak allocated by this process {peak:.2f} GiB (vLLM reserves "
          f"gpu_memory_utilization={args.gpu_memory_utilization} of the GPU for weights and KV cache); "
          f"in use on the device now {(total - free) / 2**30:.2f} / {total / 2**30:.0f} GiB")
    print(f"total time {time.perf_counter() - start:.1f}s")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("PASS" if not failures else "FAIL")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
