"""The main job (``tracegym demo``, run by ``make demo``): base -> SFT -> RL on the embedded model.

Stages, each writing under ``output_dir`` (default ``runs/demo``):

1. ``expert/``      the env's scripted expert on train tasks, recorded on the model's token path.
2. ``base/``        evaluation of the untouched model on held-out test tasks (eval.json + plots).
3. ``train_sft/``   SFT (LoRA) on the expert trajectories; ``sft/`` its evaluation.
4. ``train_rl/``    RL (GRPO, LoRA) starting from the SFT adapter; ``rl/`` its evaluation.
5. ``compare.json``, ``compare.png`` and ``report.html``; a table printed at the end.

All three evaluations use the same test tasks, samples, temperature, turn budgets and seeds, so the
differences are the training's alone. Nothing is tuned on the test tasks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from tracegym.config import LoraConfig, ModelConfig, OptimConfig, RLConfig, SFTConfig, _Section


class DemoConfig(_Section):
    """What the demo runs: by default the many-step job (3 dependent calculator calls and an answer,
    4 turns), with the RL settings that hold a strong start (``bench/strong_start.py``); the one-call
    job of earlier rounds is ``examples/demo_one_call.yaml``."""

    plugins: list[str] = Field(default_factory=list)
    """Python modules imported before this config is validated (a module name, or a ``.py`` path
    relative to the config file): they register envs and algorithms (``--plugin`` adds more)."""

    model: str = "smollm2-135m"
    """Model to start from (a known name or a local Hugging Face folder)."""

    env: str = "calculator"
    """Environment of every stage."""

    env_options: dict[str, Any] = Field(default_factory=lambda: {"num_calls": 3})
    """Options of the environment for RL and every evaluation (the task family the agent is scored on)."""

    sft_env_options: dict[str, Any] = Field(default_factory=lambda: {"num_calls": 3})
    """Options of the environment for the expert data that SFT trains on."""

    expert_tasks: int = Field(512, gt=0)
    """Train tasks the scripted expert solves to make the SFT data."""

    test_tasks: int = Field(200, gt=0)
    """Held-out test tasks of every evaluation."""

    eval_samples: int = Field(2, gt=0)
    """Samples n per test task (pass@k for k <= n)."""

    eval_ks: list[int] = Field(default_factory=lambda: [1, 2])
    """Sampling budgets k of pass@k."""

    eval_turns: list[int] = Field(default_factory=lambda: [1, 2, 3, 4])
    """Interaction budgets T of pass@(k,T); episodes run with the largest."""

    eval_concurrency: int = Field(128, gt=0)
    """Episodes of an evaluation decoding together (the engine's ``max_batch_size``). A decoding
    step's matmuls are ``[rows, 576] @ [576, N]``, and 128 rows run them closer to the CPU's rate
    than 64 (the 49152-wide output layer most of all): the SFT adapter's evaluation of 128 tasks x 2
    took a median 202 s against 258 s at 64 on a 2-core EPYC (three side-by-side pairs, 1.12-1.40x;
    the same pass@1; ``bench/eval_concurrency.py``), for 0.9 GB more peak memory. Tokens equal those
    at any other concurrency up to float rounding (each row has its own seeded generator)."""

    temperature: float = Field(0.7, ge=0)
    """Sampling temperature of evaluation and RL rollouts."""

    max_tokens_per_turn: int = Field(48, gt=0)
    """Token limit of one assistant turn (a tool call takes about 30)."""

    sft_steps: int = Field(96, gt=0)
    """SFT optimizer steps."""

    sft_batch_size: int = Field(8, gt=0)
    """Examples per SFT step."""

    sft_lr: float = Field(3e-4, gt=0)
    """SFT learning rate (LoRA)."""

    rl_steps: int = Field(10, gt=0)
    """RL optimizer steps."""

    rl_tasks_per_step: int = Field(8, gt=0)
    """Distinct train tasks per RL step."""

    rl_group_size: int = Field(6, gt=0)
    """Samples per task in an RL group (GRPO's group)."""

    rl_lr: float | None = Field(None, gt=0)
    """RL learning rate (LoRA). None: derived from ``sft_lr`` and the episodes per step by
    ``tracegym.train.optim.rl_learning_rate`` (``sft_lr / 8 * sqrt(episodes / 64)``, at most
    ``sft_lr / 4``): 3.25e-5 for 3e-4 and 8 x 6 episodes. The one-call job sets 2e-4 (its short SFT
    leaves much to gain); from a strong 3-call SFT start 2e-4 lost 0.28 pass@1 (docs/algorithms.md,
    "Why RL lost the strong start")."""

    rl_warmup_steps: int = Field(2, ge=0)
    """RL steps of linear learning-rate warmup; step k of N runs at k/(N+1) of the rate, so the
    first one already moves. RL starts a fresh Adam, whose first updates move every weight by about
    the learning rate whatever the gradient's size."""

    rl_guidance: bool = True
    """LUFFY guidance: a group whose samples all failed gets the env's expert trajectory (with
    LUFFY's shaped importance weight) before advantages, so it carries signal (``RLConfig.guidance``)."""

    rl_guidance_groups: Literal["all_failed", "every"] = "all_failed"
    """With ``rl_guidance``: which groups get the expert trajectory (``GuidanceConfig.groups``):
    ``all_failed``, or ``every`` group (LUFFY's mixed-policy setting)."""

    rl_reward_parts: dict[str, float] | None = Field(default_factory=lambda: {"answer": 1.0, "calls": 0.3})
    """Reward parts of the RL env (``env_options`` + ``reward_parts``; docs/environments.md, "Reward
    parts"): the calculator's ``calls`` part pays 1/n for each call that reproduces a reference
    intermediate result, so groups whose final answers all agree still rank their episodes. The
    evaluations score the final answer only. None: the env's default (the answer alone). Example:
    ``{"answer": 1.0, "calls": 0.3}`` (``bench/strong_start.py``)."""

    rl_estimator: str = "grpo"
    """Advantage estimator of the RL stage (``RLConfig.advantage.estimator``): ``grpo`` (one
    advantage per episode), or a turn-level one such as ``turn_rloo`` that pays each turn the return
    from that turn on, so a reward part earned at a turn (the calculator's ``calls``) credits that turn
    and those before it, not the whole episode (docs/algorithms.md, "Why RL lost the strong start")."""

    rl_max_policy_drift: float | None = Field(0.02, gt=0)
    """Trust region of each RL update (``RLConfig.max_policy_drift``): KL(pi_old || pi_new) per
    sampled token above it shrinks the step by halves (PPO's usual target KL is 0.01-0.02; the strong-start
    bench uses 0.02). None: off (the drift is still logged)."""

    rl_kl_coef: float = Field(0.0, ge=0.0)
    """KL anchor of the RL stage to its SFT start (``policy_loss.kl_coef``, k3 in the loss; the
    reference is the SFT adapter): holds the decisions RL's gradient does not target, which a shared
    representation otherwise drags along (docs/algorithms.md, "Why RL lost the strong start").
    0: off. Costs one reference forward per row."""

    rl_expert_replay: float = Field(1.0, ge=0.0)
    """Weight of the RL stage's expert-replay term (``RLConfig.expert_replay``, PPO-ptx's mix with
    the env's expert): every update adds this x the mean NLL of ``rl_tasks_per_step`` expert traces,
    in rotation through the RL train tasks, which holds the decisions the step's samples do not
    reach (docs/algorithms.md, "Why RL lost the strong start"). 0: off."""

    rl_replay_only: bool = False
    """The control of ``rl_expert_replay``: the RL stage trains on the replay term alone
    (``expert_replay.policy_gradient: false``), so a gain can be split between replay and RL."""

    micro_batch_size: int = Field(6, gt=0)
    """Sequences per forward/backward pass of the RL update: the group size, so a pass holds one
    task's samples, whose prompt (system prompt, tool schemas, question: two thirds of a 3-call
    episode) the forward runs once. Measured on 12 three-call rows in float32 on a 2-core EPYC
    (``bench/rl_update.py``): 21.9 s an update at 6 rows a pass (4450 MiB peak) against 38.4 s at 1
    with the log-prob pass of before (2721 MiB). A guided group has a 7th row (the expert's), so passes then straddle groups."""

    sft_micro_batch_size: int = Field(4, gt=0)
    """Sequences per forward/backward pass of SFT: the rows of a pass share the system prompt and
    tool schemas (half of a 3-call trace), which the forward runs once (docs/algorithms.md,
    "Log-probs"). Measured on 8 three-call traces (``bench/sft_precision.py``): on a Xeon with AMX,
    bfloat16 autocast, 6.5 s a step at 8 (5.6 GB peak) and 8.5 s at 4 (4.2 GB); on an EPYC without
    native bfloat16, float32, 15.3 s at 8 (6.2 GiB) and 14.6 s at 4 (4.2 GiB), 23.5 s at 1 in train
    mode (the demo's SFT before 2026-12-06). 4 keeps the demo's peak under 6 GiB."""

    rl_micro_batch_tokens: int | None = Field(None, gt=0)
    """The RL update's micro-batches cut by computed tokens (``RLConfig.micro_batch_tokens``): a
    group's samples share their prompt, which the forward runs once. None: ``micro_batch_size`` rows."""

    autocast: Literal["none", "bfloat16", "auto"] = "auto"
    """Mixed precision of both training stages' forward passes (``ModelConfig.autocast``): ``auto``
    runs the matmuls in bfloat16 where the CPU or GPU computes it natively (AMX / AVX512-BF16, CUDA),
    float32 elsewhere. Rollouts and evaluations sample in ``sample_dtype``."""

    sample_dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights the evaluations and the RL rollouts sample with (``HFEngine(sample_dtype=...)``): a
    copy of the policy in this dtype, its LoRA adapter merged, refreshed after every RL update.
    ``float32`` samples what the peft model samples, 1.19x faster. ``bfloat16`` is faster still on
    a CPU with AVX512-BF16 or AMX but rounds most of a merged LoRA away: on the demo's SFT adapter
    it cost pass@1 0.045 [0.020, 0.075] (bench/README.md, "Sampling copies"); the RL update then
    takes its old log-probs from the trainer, never from the sampler."""

    lora_r: int = Field(16, gt=0)
    """LoRA rank of both training stages."""

    seed: int = 0
    """Seed of sampling and training, and of the task draws unless ``task_seed`` is set."""

    task_seed: int | None = None
    """Seed of the task draws (expert train tasks, RL train tasks, held-out test tasks); None: ``seed``.
    ``tracegym demo --seeds`` pins it, so every seed is judged on the same test tasks."""

    output_dir: str = "runs/demo"
    """Where every stage writes."""

    progress: bool = True
    """Progress bars."""

    @property
    def task_draw_seed(self) -> int:
        """The seed every task draw uses: ``task_seed``, or ``seed`` when it is None."""
        return self.seed if self.task_seed is None else self.task_seed

    @model_validator(mode="after")
    def _sft_micro_batches_fit(self) -> "DemoConfig":
        if self.sft_batch_size % self.sft_micro_batch_size:
            raise ValueError(f"sft_batch_size ({self.sft_batch_size}) must be a multiple of sft_micro_batch_size "
                             f"({self.sft_micro_batch_size})")
        return self

    @model_validator(mode="after")
    def _replay_only_needs_replay(self) -> "DemoConfig":
        if self.rl_replay_only and self.rl_expert_replay <= 0:
            raise ValueError("rl_replay_only: set rl_expert_replay > 0 (the replay term is all it trains)")
        return self


def _stage(title: str, started: float) -> None:
    print(f"\n== [{time.perf_counter() - started:6.0f}s] {title}", flush=True)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run every stage; returns ``{"base": summary, "sft": summary, "rl": summary, "compare": ...}``."""
    from tracegym.envs import make
    from tracegym.eval.report import build_report
    from tracegym.models import load_tokenizer
    from tracegym.recipes.rl import train_rl
    from tracegym.recipes.sft import train_sft
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig, run_rollouts_sync
    from tracegym.data.store import TrajectoryWriter

    started = time.perf_counter()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo_config.json").write_text(cfg.model_dump_json(indent=2), encoding="utf-8")
    max_turns = max(cfg.eval_turns)
    renderer = get_renderer(cfg.model, load_tokenizer(cfg.model))

    # 1. expert data (train split of the SFT task family)
    _stage(f"1/6 scripted expert on {cfg.expert_tasks} {cfg.env} train tasks {cfg.sft_env_options}", started)
    task_seed = cfg.task_draw_seed
    train_tasks = make(cfg.env, **cfg.sft_env_options).tasks("train", cfg.expert_tasks, task_seed)
    with TrajectoryWriter(out / "expert" / "trajectories.jsonl") as writer:
        expert = run_rollouts_sync(cfg.env, train_tasks, "expert", renderer,
                                   RolloutConfig(max_turns=8, max_tokens_per_turn=256, seed=cfg.seed),
                                   writer=writer, progress=cfg.progress, env_options=cfg.sft_env_options,
                                   policy_name="expert")
    print(f"expert success rate {expert.stats.success_rate:.3f} on {expert.stats.episodes} episodes")

    test_tasks = make(cfg.env, **cfg.env_options).tasks("test", cfg.test_tasks, task_seed)
    summaries: dict[str, dict[str, Any]] = {}

    def evaluate(label: str, model_path: str) -> None:
        summary = evaluate_stage(cfg, test_tasks, renderer, model_path, out / label, label)
        summaries[label] = summary
        top = str(max_turns)
        low, high = summary["pass_at_ci"][top]["1"]
        print(f"{label}: pass@1 {summary['pass_at'][top]['1']:.3f} [{low:.3f}, {high:.3f}]  "
              f"success {summary['success_rate']:.3f}")

    # 2. the base model
    _stage(f"2/6 evaluate the base model: {cfg.test_tasks} test tasks x {cfg.eval_samples} samples {cfg.env_options}", started)
    evaluate("base", cfg.model)

    # 3. SFT on the expert data
    _stage(f"3/6 SFT: {cfg.sft_steps} steps x {cfg.sft_batch_size} expert trajectories (LoRA r={cfg.lora_r})", started)
    sft_cfg = SFTConfig(
        model=ModelConfig(name=cfg.model, autocast=cfg.autocast), lora=LoraConfig(r=cfg.lora_r, alpha=2 * cfg.lora_r),
        optim=OptimConfig(lr=cfg.sft_lr, warmup_steps=1, schedule="cosine"),
        data={"train_files": [str(out / "expert" / "trajectories.jsonl")]},
        max_steps=cfg.sft_steps, batch_size=cfg.sft_batch_size, micro_batch_size=cfg.sft_micro_batch_size,
        seed=cfg.seed, output_dir=str(out / "train_sft"), checkpoint={"every": 0, "keep_last": 1},
        logging={"tensorboard": True, "progress": cfg.progress},
    )
    _clear_run_dir(out / "train_sft")
    sft = train_sft(sft_cfg)
    _stage("4/6 evaluate the SFT model", started)
    evaluate("sft", str(sft.final_dir))

    # 4. RL from the SFT adapter
    _stage(f"5/6 RL (GRPO): {cfg.rl_steps} steps x {cfg.rl_tasks_per_step} tasks x {cfg.rl_group_size} samples", started)
    rl_cfg = rl_stage_config(cfg, sft.final_dir, out / "train_rl")
    _clear_run_dir(out / "train_rl")
    rl = train_rl(rl_cfg)
    _stage("6/6 evaluate the RL model", started)
    evaluate("rl", str(rl.final_dir))

    # 5. compare and report
    comparison = compare_summaries(summaries, str(max_turns))
    (out / "compare.json").write_text(json.dumps(comparison, indent=2), encoding="utf-8")
    report = build_report(out, tokenizer=load_tokenizer(cfg.model))
    _stage(f"done: {out}/{{base,sft,rl}}/eval.json, {report}", started)
    print_comparison(comparison, cfg, time.perf_counter() - started)
    return {**summaries, "compare": comparison}


def eval_rollout_config(cfg: DemoConfig) -> Any:
    """The episodes of every evaluation (base, SFT, RL): same samples, temperature, turns and seeds."""
    from tracegym.rollout import RolloutConfig

    return RolloutConfig(max_turns=max(cfg.eval_turns), max_tokens_per_turn=cfg.max_tokens_per_turn,
                         temperature=cfg.temperature, samples_per_task=cfg.eval_samples,
                         seed=cfg.seed + 12345, concurrency=cfg.eval_concurrency)


def evaluate_stage(cfg: DemoConfig, test_tasks: Any, renderer: Any, model_path: str | Path, out: Path,
                   label: str) -> dict[str, Any]:
    """One evaluation (base, SFT or RL) on the demo's held-out tasks, written to ``out``; its summary."""
    from tracegym.engines import make_engine
    from tracegym.recipes.evaluate import evaluate_to_dir

    engine = make_engine("hf", model=str(model_path), renderer=renderer, max_batch_size=cfg.eval_concurrency,
                         sample_dtype=cfg.sample_dtype)
    summary, _, _ = evaluate_to_dir(cfg.env, test_tasks, engine, renderer, eval_rollout_config(cfg), cfg.eval_ks,
                                    cfg.eval_turns, out, env_options=cfg.env_options, policy_name=label,
                                    progress=cfg.progress, extra={"base_model": cfg.model, "checkpoint": str(model_path),
                                           "sample_dtype": str(engine.sample_dtype).removeprefix("torch.")})
    return summary


def rl_stage_config(cfg: DemoConfig, sft_adapter: str | Path, output_dir: str | Path) -> RLConfig:
    """Stage 5: GRPO (LoRA) from the SFT adapter, on the env and turn budget the evaluations use
    (``bench/rl_from_sft.py`` reruns it with other settings)."""
    return RLConfig(
        model=ModelConfig(name=cfg.model, adapter=str(sft_adapter), autocast=cfg.autocast),
        lora=LoraConfig(r=cfg.lora_r, alpha=2 * cfg.lora_r),
        optim=OptimConfig(lr=demo_rl_lr(cfg), warmup_steps=cfg.rl_warmup_steps, schedule="constant"),
        env={"name": cfg.env, "options": {**cfg.env_options,
                                          **({"reward_parts": cfg.rl_reward_parts} if cfg.rl_reward_parts else {})}},
        tasks={"train": max(cfg.rl_steps * cfg.rl_tasks_per_step, 8), "test": 0,
               "seed": cfg.task_draw_seed},
        tasks_per_step=cfg.rl_tasks_per_step, group_size=cfg.rl_group_size,
        rollout={"max_turns": max(cfg.eval_turns), "max_tokens_per_turn": cfg.max_tokens_per_turn,
                 "temperature": cfg.temperature, "concurrency": 64,
                 "engine_options": {"sample_dtype": cfg.sample_dtype}},
        advantage={"estimator": cfg.rl_estimator},
        policy_loss={"loss": "ppo_clip", "clip_eps_low": 0.2, "clip_eps_high": 0.28, "kl_coef": cfg.rl_kl_coef},
        micro_batch_size=cfg.micro_batch_size, micro_batch_tokens=cfg.rl_micro_batch_tokens, steps=cfg.rl_steps,
        max_length=2048,
        guidance={"groups": cfg.rl_guidance_groups} if cfg.rl_guidance else None, max_policy_drift=cfg.rl_max_policy_drift,
        expert_replay={"coef": cfg.rl_expert_replay, "tasks": max(cfg.rl_steps * cfg.rl_tasks_per_step, 8),
                       "per_step": cfg.rl_tasks_per_step, "policy_gradient": not cfg.rl_replay_only}
        if cfg.rl_expert_replay > 0 else None,
        eval={"every": 0, "at_start": False, "temperature": cfg.temperature}, seed=cfg.seed, output_dir=str(output_dir),
        checkpoint={"every": 0, "keep_last": 1}, logging={"tensorboard": True, "progress": cfg.progress},
    )


def demo_rl_lr(cfg: DemoConfig) -> float:
    """``rl_lr``, or the rate derived from the SFT rate and the episodes per step."""
    from tracegym.train.optim import rl_learning_rate

    if cfg.rl_lr is not None:
        return cfg.rl_lr
    return rl_learning_rate(cfg.sft_lr, cfg.rl_tasks_per_step * cfg.rl_group_size)


def _clear_run_dir(path: Path) -> None:
    """A fresh demo run starts fresh training runs (the demo is not resumable stage by stage)."""
    import shutil

    if path.exists():
        shutil.rmtree(path)


def compare_summaries(summaries: dict[str, dict[str, Any]], top_turns: str) -> dict[str, Any]:
    """pass@1 with CIs per stage, and paired bootstrap differences (sft - base, rl - sft)."""
    from tracegym.eval.metrics import paired_bootstrap_diff, solved_per_task

    rows = {}
    for label, s in summaries.items():
        rows[label] = {
            "pass@1": s["pass_at"][top_turns]["1"],
            "pass@1_ci": s["pass_at_ci"][top_turns]["1"],
            "pass_at": s["pass_at"],
            "success_rate": s["success_rate"],
            "turns": s["cost"]["turns"],
            "generated_tokens": s["cost"]["generated_tokens"],
            "tool_calls": s["cost"]["tool_calls"],
        }
    diffs = {}
    for new, old in (("sft", "base"), ("rl", "sft"), ("rl", "base")):
        if new in summaries and old in summaries:
            diff, low, high, shared = paired_bootstrap_diff(solved_per_task(summaries[old], top_turns),
                                                             solved_per_task(summaries[new], top_turns), 1)
            diffs[f"{new}-{old}"] = {"diff": diff, "ci": [low, high], "tasks": shared}
    return {"turns": int(top_turns), "stages": rows, "paired_diff_pass@1": diffs}


def print_comparison(comparison: dict[str, Any], cfg: DemoConfig, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{cfg.model} on {cfg.env} {cfg.env_options}: {cfg.test_tasks} held-out tasks x "
                        f"{cfg.eval_samples} samples, T={comparison['turns']}, temperature {cfg.temperature}")
    for column in ("stage", "pass@1 [95% CI]", f"pass@{max(cfg.eval_ks)}", "success", "turns", "tokens/episode"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    top = str(comparison["turns"])
    for label, row in comparison["stages"].items():
        low, high = row["pass@1_ci"]
        table.add_row(label, f"{row['pass@1']:.3f} [{low:.3f}, {high:.3f}]",
                      f"{row['pass_at'][top].get(str(max(cfg.eval_ks)), float('nan')):.3f}",
                      f"{row['success_rate']:.3f}", f"{row['turns']:.2f}", f"{row['generated_tokens']:.1f}")
    console = Console()
    console.print(table)
    for name, d in comparison["paired_diff_pass@1"].items():
        console.print(f"  {name}: Δpass@1 {d['diff']:+.3f}  95% CI [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] (paired bootstrap over tasks)")
    console.print(f"  total time {seconds / 60:.1f} min")
