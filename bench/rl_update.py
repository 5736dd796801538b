"""The RL update of the demo's RL stage by micro-batch and output layer, side by side.

One RL update (``policy_update``: PPO-clip, log-probs and entropy, backward, AdamW step) on a batch
shaped like the demo's: ``--tasks`` groups of 6 three-call calculator episodes (the env's expert
episodes, 4 turns each, about 500 tokens of which the first two thirds are the shared prompt),
advantages +-1, engine log-probs present (no re-scoring), float32, LoRA r=16 on SmolLM2-135M. Each
setting runs in its own process (its peak RSS is its own):

- ``1 row a pass, full logits, 1024-position chunks``: the demo's RL update until 2026-12-06 (the
  model's [B, L, V] logits, then the log-prob and entropy pass in chunks of 1024 positions);
- ``6 rows a pass``: a group a pass, its prompt run once (the shared prefix);
- ``full logits`` against the fused output layer (``tracegym/train/logprobs.py``: no [B, L, V]
  logits), and the positions per chunk of the log-prob pass (32 now);
- ``bfloat16``: the forwards under bfloat16 autocast (``model.autocast``, the demo's choice on CPUs
  with AMX or AVX512-BF16). The engine's float32 log-probs are then not the trainer's, so the
  timed unit includes ``score_batch``: a re-scoring pass over the whole batch first (the RL recipe
  until 2026-12-06), or the old log-probs taken from the update's own forward (``old_from_forward``,
  one pass: ``tracegym/train/policy_update.py``). On a CPU without native bfloat16 these two
  settings are slow (emulated) and beside the point;
- ``expert replay``: the demo's update, with its replay term (as many expert traces as groups,
  PPO-ptx's NLL mix), the system prompt every row starts with run per micro-batch (the code before
  2026-12-07) or once per update, forward and backward (``tracegym/train/step_prefix.py``).

Run from the repository root, nothing else on the CPU::

    .venv/bin/python bench/rl_update.py [--tasks 4] [--updates 2] [--only "6 rows a pass" ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = {  # name: (micro-batch rows, fused output layer, positions per log-prob chunk, autocast, old_from_forward,
    #               expert replay, step prefix)
    "1 row a pass, full logits, 1024-position chunks": (1, False, 1024, "none", False, False, False),
    "6 rows a pass, full logits, 1024-position chunks": (6, False, 1024, "none", False, False, False),
    "1 row a pass, full logits": (1, False, 32, "none", False, False, False),
    "6 rows a pass, full logits": (6, False, 32, "none", False, False, False),
    "6 rows a pass, 128-position chunks": (6, True, 128, "none", False, False, False),
    "6 rows a pass": (6, True, 32, "none", False, False, False),
    "6 rows a pass, bfloat16, re-scoring pass first": (6, True, 32, "bfloat16", False, False, False),
    "6 rows a pass, bfloat16, old log-probs from the update's forward": (6, True, 32, "bfloat16", True, False, False),
    "6 rows a pass, expert replay, prompt per micro-batch": (6, True, 32, "none", True, True, False),
    "6 rows a pass, expert replay, system prompt once per update": (6, True, 32, "none", True, True, True),
}


def run_setting(name: str, tasks: int, updates: int) -> dict:
    import torch

    import tracegym.train.logprobs as logprobs
    from tracegym.algos.config import PolicyLossConfig
    from tracegym.batch import examples_from_groups, make_batch
    from tracegym.envs import make
    from tracegym.recipes._run import split_tasks
    from tracegym.recipes.demo import DemoConfig, rl_stage_config
    from tracegym.rl.collect import expert_episodes
    from tracegym.rl.policy import load_policy, make_renderer
    from tracegym.train.optim import build_optimizer, build_scheduler
    from tracegym.train.policy_update import policy_update, score_batch
    from tracegym.types import TrajectoryGroup

    micro_batch_size, fused, chunk_rows, autocast, old_from_forward, with_replay, step_prefix = SETTINGS[name]
    if not step_prefix:  # each micro-batch runs the system prompt itself (the code before 2026-12-07)
        import tracegym.train.policy_update as policy_update_module

        policy_update_module.step_prefix = lambda *args, **kwargs: None
    if not fused:
        logprobs.FUSED_HEAD_MODEL_TYPES = frozenset()
    logprobs.DEFAULT_CHUNK_ROWS = logprobs.FUSED_CHUNK_ROWS = chunk_rows
    cfg = rl_stage_config(DemoConfig(autocast=autocast), "unused", "/tmp/bench-rl-update")
    cfg.model.adapter = None  # a fresh adapter: the same arithmetic as the SFT one
    loss_cfg = PolicyLossConfig(**cfg.policy_loss)
    model, tokenizer, reference = load_policy(cfg, loss_cfg, torch.device("cpu"))
    renderer = make_renderer(cfg, tokenizer)
    train_tasks, _ = split_tasks(cfg, make(cfg.env.name, **cfg.env.options))
    episodes = list(expert_episodes(cfg, train_tasks[: 2 * tasks], renderer, seed=1).values())[:tasks]
    group_size = DemoConfig().rl_group_size
    groups = [TrajectoryGroup(task_id=e.task_id, env=cfg.env.name, trajectories=tuple([e] * group_size)) for e in episodes]
    advantages = [[[1.0 if i % 2 else -1.0] * len(e.turns) for i in range(group_size)] for e in episodes]
    data = examples_from_groups(groups, renderer, advantages)
    batch = make_batch(data.examples, pad_token_id=tokenizer.pad_token_id, group_ids=data.group_index,
                       trajectory_ids=data.trajectory_ids)
    batch = dataclasses.replace(batch, has_engine_logprobs=torch.ones_like(batch.has_engine_logprobs))  # as sampled
    replay = None
    if with_replay:  # the demo's PPO-ptx term: as many expert traces as groups, coefficient 1
        replay = (make_batch([x for e in episodes for x in renderer.build_examples(e)], pad_token_id=tokenizer.pad_token_id),
                  1.0)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, updates)
    seconds, losses = [], []
    for _ in range(updates):
        start = time.perf_counter()
        scored = score_batch(model, reference, batch, loss_cfg, micro_batch_size=micro_batch_size, temperature=0.7,
                             old_from_forward=old_from_forward)  # a no-op in float32 (the engine's log-probs stand)
        metrics = policy_update(model, scored, loss_cfg, optimizer, scheduler, epochs=1, micro_batch_size=micro_batch_size,
                                temperature=0.7, max_grad_norm=1.0, old_from_forward=old_from_forward, replay=replay)
        seconds.append(time.perf_counter() - start)
        losses.append(metrics["train/loss"])
    return {"update_s": seconds, "loss": losses[0], "rows": batch.size, "tokens": int(batch.attention_mask.sum()),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=4, help="groups of 6 episodes in the batch")
    parser.add_argument("--updates", type=int, default=2, help="timed updates per setting")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2))
    parser.add_argument("--only", nargs="*", choices=list(SETTINGS), help="these settings alone (default: all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(run_setting(args.worker, args.tasks, args.updates)), flush=True)
        return 0

    from stages import machine_line, print_settings_table, run_settings

    results = run_settings(__file__, {name: [name, "--tasks", str(args.tasks), "--updates", str(args.updates), "--threads",
                                             str(args.threads)] for name in (args.only or SETTINGS)})
    first = next(iter(results.values()))
    print(f"{machine_line(args.threads)} | smollm2-135m, LoRA r=16, {first['rows']} rows ({args.tasks} groups x 6 "
          f"three-call episodes, {first['tokens']} tokens), {args.updates} timed updates per setting")
    print_settings_table(results, "update_s", "update", "loss", 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
