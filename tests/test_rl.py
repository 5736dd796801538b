"""RL recipe on the tiny random model: every loss option runs and logs, every trainable weight moves
(and no frozen one), the engine serves the new weights, resume is exact, it learns an easy task,
the logged numbers do not depend on the micro-batch size, and config mistakes are named.

Most tests use ``LetterEnv`` (defined here): the reply is rewarded when it contains a letter. A
random model's three-token replies contain "m" about a third of the time (one-token replies "e"
about half the time), so groups are rarely uniform and advantages are non-zero; the calculator env (reward 0 for a random model) runs through the CLI.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch
from safetensors.torch import load_file

import tracegym.rl.collect as rl_collect
import tracegym.rl.policy as rl_policy
import tracegym.rl.scoring as rl_scoring
import tracegym.rl.tasks as rl_tasks
from tracegym.config import RLConfig, load_config
from tracegym.envs import register, unregister
from tracegym.envs.base import Env, Task
from tracegym.recipes.rl import train_rl
from tracegym.rl.tasks import tasks_for_step
from tracegym.train.checkpoint import list_checkpoints
from tracegym.train.logging import read_metrics
from tracegym.types import Message, SamplingParams, StepResult

# Keys that hold wall-clock times or machine load: everything else must be reproducible exactly.
NON_DETERMINISTIC = ("time", "rss_mb", "time/", "rollout/tokens_per_s", "train/tokens_per_s")


class LetterEnv(Env):
    """Reply with a word containing ``letter``: reward 1 and the episode ends; otherwise the user asks
    again, until ``max_turns`` replies (then truncated, reward 0)."""

    name = "test-letter"

    def __init__(self, letter: str = "e", max_turns: int = 1):
        self.letter, self.max_turns, self.turn = letter, max_turns, 0

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        offset = 0 if split == "train" else 10_000  # disjoint splits
        return [Task(id=f"{split}-{seed}-{i}", split=split, data={"word": f"w{offset + i}"}) for i in range(n)]

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    async def reset(self, task: Task) -> list[Message]:
        self.turn = 0
        return [Message(role="system", content="Reply with one word."),
                Message(role="user", content=f"Word {task.data['word']}")]

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        self.turn += 1
        if self.letter in message.content:
            return StepResult(reward=1.0, terminated=True, info={"success": True})
        last = self.turn >= self.max_turns
        again = () if last else (Message(role="user", content="Again."),)
        return StepResult(messages=again, reward=0.0, truncated=last, info={"success": False})

    def expert_action(self) -> Message:
        return Message(role="assistant", content=self.letter)


@pytest.fixture(autouse=True, scope="module")
def letter_env():
    register("test-letter", LetterEnv, overwrite=True)
    yield
    unregister("test-letter")


def _config(out: Path, *overrides: str, env: str = "test-letter") -> RLConfig:
    data = {
        "model": {"name": "tiny-random"},
        "lora": {"enabled": True, "r": 4},
        "optim": {"lr": 1e-3},
        "env": {"name": env, "options": {"letter": "m", "max_turns": 2} if env == "test-letter" else {"num_calls": 1}},
        "tasks": {"train": 6, "test": 2, "seed": 0},
        "tasks_per_step": 3,
        "group_size": 4,
        "rollout": {"max_turns": 2, "max_tokens_per_turn": 3, "concurrency": 16},
        "micro_batch_size": 4,
        "steps": 2,
        "eval": {"every": 1, "samples_per_task": 2, "temperature": 1.0},
        "output_dir": str(out),
        "logging": {"progress": False, "tensorboard": False},
    }
    return load_config(RLConfig, data=data, overrides=list(overrides))


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    return [row for row in read_metrics(run_dir) if row["step"] > 0]


# Logged every step by every run that trained (the loss-specific keys are checked per option).
ALWAYS = ("reward/mean", "reward/std", "success_rate", "episode/turns", "episode/generated_tokens", "env/errors",
          "rollout/tokens_per_s", "time/rollout_s", "time/train_s", "time/step_s", "time/score_s", "time/update_s",
          "time/drift_s", "rss_mb", "groups/no_signal",
          "examples/count", "train/loss", "train/entropy", "train/ratio_mean", "train/ratio_min", "train/ratio_max",
          "train/grad_norm", "train/tokens_per_s", "lr")
CLIPPED = ("train/clip_frac", "train/clip_frac_low", "train/clip_frac_high", "train/approx_kl")


def test_tasks_for_step_is_a_pure_function_covering_each_epoch():
    tasks = list(range(5))
    first_epoch = [t for step in range(5) for t in tasks_for_step(tasks, 1, seed=3, step=step)]
    assert sorted(first_epoch) == tasks  # every task once per epoch
    assert tasks_for_step(tasks, 2, 3, 4) == tasks_for_step(tasks, 2, 3, 4)
    # step 2 of 2 per step wraps: slots 4, 5 = last of epoch 0, first of epoch 1
    assert tasks_for_step(tasks, 2, 3, 2)[0] == first_epoch[4]


def test_cli_runs_rl_on_the_calculator_env(tmp_path, capsys):
    from tracegym.cli import main

    config = tmp_path / "rl.yaml"
    config.write_text(
        "model: {name: tiny-random}\nlora: {r: 4}\nenv: {name: calculator, options: {num_calls: 1}}\n"
        "tasks: {train: 4, test: 2}\ntasks_per_step: 2\ngroup_size: 2\n"
        "rollout: {max_turns: 2, max_tokens_per_turn: 6, concurrency: 8}\nsteps: 2\n"
        f"output_dir: '{tmp_path / 'run'}'\nlogging: {{progress: false, tensorboard: false}}\n"
    )
    # A random model never answers right: every group is uniform and skipped unless told otherwise.
    assert main(["rl", "--config", str(config), "skip_uniform_groups=false", "eval.every=1"]) == 0
    assert "rl done: 2 steps" in capsys.readouterr().out
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/pass@1"] == 0.0 and rows[0]["params/trainable"] < rows[0]["params/total"]
    for row in rows[1:]:
        assert row["reward/mean"] == 0.0 and row["groups/no_signal"] == 2.0 and row["examples/count"] == 4.0
        assert row["train/loss"] == 0.0 and row["train/grad_norm"] == 0.0  # zero advantages, no KL: no gradient
        assert row["eval/pass@1"] == 0.0 and row["env/errors"] == 0.0
        assert row["end/terminated"] + row.get("end/max_turns", 0.0) == 4.0
    run = tmp_path / "run"
    assert (run / "final" / "adapter_config.json").is_file() and len(list((run / "rollouts").glob("*.jsonl"))) == 2
    assert load_config(RLConfig, run / "config.yaml").group_size == 2
    assert main(["rl", "--config", str(config)]) == 1  # checkpoints there: --resume or another folder
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, expected",
    [
        pytest.param(("policy_loss.loss=ppo_clip", "policy_loss.clip_eps_high=0.28"), CLIPPED, id="ppo_clip-lora"),
        pytest.param(("policy_loss.loss=gspo", "lora.enabled=false", "optim.lr=1e-4"), CLIPPED, id="gspo-full"),
        pytest.param(("policy_loss.loss=policy_gradient",), (), id="policy_gradient"),
        pytest.param(("policy_loss.kl_coef=0.1", "lora.enabled=false"), CLIPPED + ("train/kl_ref",), id="kl_loss-full"),
        pytest.param(("policy_loss.kl_coef=0.1", "policy_loss.kl_penalty=reward"), CLIPPED + ("reward/kl_penalty",),
                     id="kl_reward-lora"),
        pytest.param(("policy_loss.tis_cap=2.0",), CLIPPED + ("train/tis_truncated_frac",), id="tis"),
        pytest.param(("ppo_epochs=2", "policy_loss.dual_clip_c=3.0"), CLIPPED, id="ppo_epochs2"),
        pytest.param(("rollout.context.policy=summarize", "rollout.context.summarize_at=1",
                      "rollout.context.max_summary_tokens=3", "advantage.estimator=turn_rloo"),
                     CLIPPED + ("episode/summaries",), id="summarize-turn_rloo"),
    ],
)
def test_loss_options_run_and_log(tmp_path, options, expected):
    result = train_rl(_config(tmp_path / "run", *options, "optim.lr=1e-2"))
    assert result.step == 2 and result.final_dir is not None
    rows = _steps(result.run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        missing = [k for k in (*ALWAYS, *expected, "eval/pass@1", "eval/success_rate") if k not in row]
        assert not missing, missing
        assert row["examples/count"] > 0 and row["groups/no_signal"] < 3  # letter rewards vary
        assert all(math.isfinite(row[k]) for k in ALWAYS)
        assert 1.0 <= row["episode/turns"] <= 2.0 and 0 < row["reward/mean"] < 1
        assert row["train/grad_norm"] > 0 and row["train/entropy"] > 0
    first, second = rows
    if "ppo_epochs=2" in options:
        # pass 2 is off-policy: the ratio leaves 1 (pass 1 contributes exactly 1 to min/max)
        assert first["train/ratio_min"] < 1.0 - 1e-4 or first["train/ratio_max"] > 1.0 + 1e-4
    else:
        # on-policy single pass: engine and trainer log-probs agree, the ratio is 1, nothing is clipped
        assert first["train/ratio_min"] == pytest.approx(1.0, abs=1e-4)
        assert first["train/ratio_max"] == pytest.approx(1.0, abs=1e-4)
        assert first.get("train/clip_frac", 0.0) == 0.0
    if "train/kl_ref" in expected:  # the policy starts as the reference, then moves away from it
        assert first["train/kl_ref"] == pytest.approx(0.0, abs=1e-6) and second["train/kl_ref"] > 1e-6
    if "reward/kl_penalty" in expected:
        assert first["reward/kl_penalty"] == pytest.approx(0.0, abs=1e-6) and second["reward/kl_penalty"] > 1e-6
    if "train/tis_truncated_frac" in expected:
        assert first["train/tis_truncated_frac"] == 0.0  # engine == trainer: no weight above the cap


@pytest.mark.parametrize("penalty, key", [("loss", "train/kl_ref"), ("reward", "reward/kl_penalty")])
def test_kl_reference_after_sft_is_the_sft_model(tmp_path, penalty, key):
    """RL from an SFT adapter anchors the KL at that adapter's model, the policy at step 0, not at the
    bare base: the first step's KL is 0 although the adapter changes the outputs."""
    from tracegym.config import LoraConfig
    from tracegym.models import load
    from tracegym.rl.policy import load_policy
    from tracegym.algos.config import PolicyLossConfig
    from tracegym.train.lora import prepare_model, save_weights

    sft, _ = load("tiny-random")
    sft = prepare_model(sft, LoraConfig(r=4))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sft.named_parameters():
            if "lora_B" in name:  # a trained-looking adapter: B != 0
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    save_weights(sft, tmp_path / "sft")
    cfg = _config(tmp_path / "run", f"model.adapter={tmp_path / 'sft'}", "policy_loss.kl_coef=0.1",
                  f"policy_loss.kl_penalty={penalty}", "optim.lr=1e-2")
    model, _, reference = load_policy(cfg, PolicyLossConfig(**cfg.policy_loss), torch.device("cpu"))
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        policy_logits = model(input_ids=ids).logits
        with model.disable_adapter():
            base_logits = model(input_ids=ids).logits
        reference_logits = reference(input_ids=ids).logits
    assert (policy_logits - base_logits).abs().max() > 1e-3  # the base is not the starting policy
    torch.testing.assert_close(reference_logits, policy_logits, atol=1e-5, rtol=0)
    assert not any(p.requires_grad for p in reference.parameters())

    first, second = _steps(train_rl(cfg).run_dir)
    assert first[key] == pytest.approx(0.0, abs=1e-6) and second[key] > 1e-6


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    return {name: (p.detach().clone(), p.requires_grad) for name, p in model.named_parameters()}


def _one_step(cfg: RLConfig) -> dict[str, Any]:
    """The pieces of one RL step, called as ``train_rl`` calls them (no monkeypatching)."""
    from tracegym.algos import compute_advantages, has_signal
    from tracegym.algos.config import PolicyLossConfig
    from tracegym.batch import examples_from_groups, make_batch
    from tracegym.envs import make
    from tracegym.render import get_renderer
    from tracegym.train.optim import build_optimizer, build_scheduler
    from tracegym.train.policy_update import policy_update, score_batch

    loss_cfg = PolicyLossConfig(**cfg.policy_loss)
    model, tokenizer, reference = rl_policy.load_policy(cfg, loss_cfg, torch.device("cpu"))
    renderer = get_renderer(cfg.model.renderer or cfg.model.name, tokenizer)
    sampler = rl_policy.make_sampler(cfg, model, tokenizer, renderer)
    before = _snapshot(model)
    tasks = rl_tasks.tasks_for_step(make(cfg.env.name, **cfg.env.options).tasks("train", cfg.tasks.train), cfg.tasks_per_step, 0, 0)
    groups, result = rl_collect.collect_groups(sampler, cfg, tasks, renderer, seed=0)
    advantages = compute_advantages(cfg.advantage.estimator, groups, cfg.advantage.options)
    data = examples_from_groups(groups, renderer, advantages, skip_groups=[not has_signal(a) for a in advantages])
    batch = score_batch(model, reference, make_batch(data.examples, pad_token_id=tokenizer.eos_token_id), loss_cfg,
                        micro_batch_size=cfg.micro_batch_size, temperature=1.0, epochs=cfg.ppo_epochs)
    optimizer = build_optimizer(model, cfg.optim)
    metrics = policy_update(model, batch, loss_cfg, optimizer, build_scheduler(optimizer, cfg.optim, 10), epochs=cfg.ppo_epochs,
                            micro_batch_size=cfg.micro_batch_size, temperature=1.0, max_grad_norm=1.0)
    sampler.update_weights(model)
    return {"model": model, "before": before, "metrics": metrics, "sampler": sampler, "renderer": renderer,
            "tokenizer": tokenizer, "groups": groups, "examples": data.examples}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_step_moves_every_trainable_parameter_and_no_frozen_one(tmp_path, lora):
    # LoRA's B starts at 0, so A gets no gradient on the first update: two passes (ppo_epochs=2)
    # move both factors within one RL step.
    options = ("lora.enabled=true", "ppo_epochs=2") if lora else ("lora.enabled=false",)
    step = _one_step(_config(tmp_path / "run", *options, "optim.lr=1e-3"))
    assert step["examples"] and step["metrics"]["train/grad_norm"] > 0
    before, after = step["before"], dict(step["model"].named_parameters())
    trainable = [n for n, (_, grad) in before.items() if grad]
    frozen = [n for n, (_, grad) in before.items() if not grad]
    assert trainable and (frozen if lora else not frozen)
    if lora:
        assert all("lora_" in n for n in trainable) and {n.split(".")[-3] for n in trainable} == {"lora_A", "lora_B"}
    unchanged = [n for n in trainable if torch.equal(before[n][0], after[n].detach())]
    assert not unchanged, unchanged
    moved = [n for n in frozen if not torch.equal(before[n][0], after[n].detach())]
    assert not moved, moved


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_engine_serves_the_updated_weights(tmp_path, tokenizer, lora):
    """The sampler's log-probs for a fixed prompt change after the update and equal a teacher-forced
    pass of the model saved by ``save_final`` (so the adapter really is what the engine samples from)."""
    from tracegym.models import load
    from tracegym.render import get_renderer
    from tracegym.train.checkpoint import save_final
    from tracegym.train.logprobs import token_logprobs

    renderer = get_renderer("tiny-random", tokenizer)
    prompt = renderer.render_prompt([Message(role="system", content="Reply."), Message(role="user", content="Hello")])
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    cfg = _config(tmp_path / "run", f"lora.enabled={str(lora).lower()}", "optim.lr=1e-2")
    from tracegym.algos.config import PolicyLossConfig

    model, tok, _ = rl_policy.load_policy(cfg, PolicyLossConfig(), torch.device("cpu"))
    baseline = rl_policy.make_sampler(cfg, model, tok, renderer).generate([prompt], greedy)[0][0]
    step = _one_step(cfg)  # same seed and config: the same initial weights, then one update
    after = step["sampler"].generate([prompt], greedy)[0][0]
    changed = baseline.token_ids != after.token_ids or max(
        abs(a - b) for a, b in zip(baseline.logprobs, after.logprobs)) > 1e-3
    assert changed, (baseline, after)

    final = save_final(step["model"], step["tokenizer"], tmp_path / "run", {"base_model": "tiny-random", "lora": lora})
    saved, _ = load(str(final))  # adapter folder (on tiny-random) or full model
    ids = torch.tensor([list(prompt) + list(after.token_ids)])
    with torch.no_grad():
        reference = token_logprobs(saved, ids, torch.ones_like(ids))[0, len(prompt) - 1:]
    assert torch.allclose(reference, torch.tensor(after.logprobs), atol=1e-4), (reference, after.logprobs)


def test_kl_in_reward_lands_on_the_last_turn():
    from tracegym.types import Trajectory, Turn

    turns = tuple(Turn(prompt_ids=(1,), completion_ids=(2,), message=Message(role="assistant"), reward=r) for r in (0.0, 1.0))
    traj = Trajectory(env="e", task_id="t", messages=(), turns=turns, reward=1.0)
    shifted = rl_scoring.with_reward_offset(traj, -0.25)
    assert [t.reward for t in shifted.turns] == [0.0, 0.75] and shifted.reward == 0.75
    assert rl_scoring.with_reward_offset(traj, 0.0) is traj


def test_kl_in_reward_is_beta_times_the_summed_kl_of_every_row_of_the_episode(monkeypatch):
    # kl_penalty: reward has one implementation, kl_in_reward (docs/algorithms.md). Policy log-probs 0, reference
    # -0.5 on every column: k1 = logp - ref = 0.5 per sampled token; beta 0.2 -> 0.1 per sampled token.
    from types import SimpleNamespace

    from tracegym.algos.config import PolicyLossConfig
    from tracegym.render.trajectory_examples import build_examples
    from tracegym.types import Trajectory, TrajectoryGroup, Turn

    def turn(prompt, completion, reward=0.0):
        return Turn(prompt_ids=prompt, completion_ids=completion, message=Message(role="assistant"), reward=reward)

    # a: turn 1's prompt does not extend turn 0's (history rewritten): two rows, 2 + 3 sampled tokens
    split = Trajectory(env="e", task_id="t", sample_index=0, messages=(), reward=1.0,
                       turns=(turn((1, 2), (3, 4)), turn((1, 9, 5), (6, 7, 8), 1.0)))
    whole = Trajectory(env="e", task_id="t", sample_index=1, messages=(), reward=0.0, turns=(turn((1, 2), (3, 5)),))

    renderer = SimpleNamespace(build_examples=build_examples)  # all kl_in_reward needs of a renderer
    monkeypatch.setattr(rl_scoring, "batch_logprobs", lambda model, batch, *a, **k: torch.zeros(batch.loss_mask.shape))
    monkeypatch.setattr(rl_scoring, "reference_logprobs", lambda model, ref, batch, *a, **k: torch.full(batch.loss_mask.shape, -0.5))
    cfg = PolicyLossConfig(kl_coef=0.2, kl_estimator="k1", kl_penalty="reward")
    groups = [TrajectoryGroup(env="e", task_id="t", trajectories=(split, whole))]
    out, mean_penalty = rl_scoring.kl_in_reward(groups, None, None, renderer, cfg, pad_token_id=0, micro_batch_size=1,
                                               temperature=1.0)
    a, b = out[0].trajectories
    assert a.reward == pytest.approx(1.0 - 0.5) and [t.reward for t in a.turns] == [0.0, pytest.approx(0.5)]
    assert b.reward == pytest.approx(-0.2) and [t.reward for t in b.turns] == [pytest.approx(-0.2)]
    assert mean_penalty == pytest.approx((0.5 + 0.2) / 2)


def test_presets_fill_settings_under_the_users_own():
    cfg = load_config(RLConfig, data={"preset": "dr_grpo", "rollout": {"max_turns": 3, "max_tokens_per_turn": 64}})
    assert cfg.advantage.estimator == "dr_grpo"
    assert cfg.policy_loss == {"loss": "ppo_clip", "aggregation": "fixed_length_sum", "fixed_length": 192}
    cfg = load_config(RLConfig, data={"preset": "dapo", "policy_loss": {"clip_eps_high": 0.3}})
    assert cfg.policy_loss["clip_eps_low"] == 0.2 and cfg.policy_loss["clip_eps_high"] == 0.3  # the user's wins
    assert cfg.resample_rounds == 2 and cfg.policy_loss["aggregation"] == "token_mean"
    cfg = load_config(RLConfig, data={"preset": "gspo"})
    assert cfg.policy_loss["loss"] == "gspo" and cfg.policy_loss["clip_eps_low"] == 3e-4
    with pytest.raises(Exception, match="preset"):
        load_config(RLConfig, data={"preset": "grpoo"})


def test_dynamic_sampling_replaces_groups_without_signal(tmp_path):
    # "q" is rare in random three-token replies: most groups are uniform (all 0) and get replaced
    cfg = _config(tmp_path / "run", "env.options.letter=q", "resample_rounds=3", "steps=1", "eval.at_start=false",
                  "eval.every=0", "tasks.test=1", "tasks.train=12")
    (row,) = _steps(train_rl(cfg).run_dir)
    assert row["groups/resample_rounds"] >= 1
    rollouts = (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    assert len(rollouts) == cfg.group_size * cfg.tasks_per_step * (1 + int(row["groups/resample_rounds"]))


def _final_tensors(final_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(final_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    assert tensors
    return tensors


def _reproducible(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in NON_DETERMINISTIC and not k.startswith("time/")} for r in rows]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_resume_matches_straight_run_exactly(tmp_path, lora):
    # Multi-turn episodes, two PPO passes, KL to the reference and a cosine schedule with warmup:
    # optimizer, scheduler, task cursor and sampling seeds must all come back.
    common = (f"lora.enabled={str(lora).lower()}", "steps=4", "ppo_epochs=2", "policy_loss.kl_coef=0.05", "resample_rounds=1",
              "optim.warmup_steps=2", "optim.schedule=cosine", "optim.lr=1e-2", "eval.every=2", "tasks.train=3")
    straight = train_rl(_config(tmp_path / "a", *common))

    cfg = _config(tmp_path / "b", *common, "checkpoint.every=2")
    # Killed after step 3: the last checkpoint is step 2, so step 3 is trained (and logged) twice.
    interrupted = train_rl(cfg, stop_at_step=3)
    assert interrupted.final_dir is None and [s for s, _ in list_checkpoints(cfg.output_dir)] == [2]
    resumed = train_rl(cfg, resume=True)
    assert resumed.step == 4 and [r["step"] for r in resumed.history] == [3, 4]

    a, b = _reproducible(read_metrics(straight.run_dir)), _reproducible(read_metrics(resumed.run_dir))
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert a == b  # every step once, identical numbers (rewards, losses, ratios, KL, grad norms, eval)
    assert len({r["reward/mean"] for r in a[1:]}) > 1 or len({r["train/loss"] for r in a[1:]}) > 1
    fa, fb = _final_tensors(straight.final_dir), _final_tensors(resumed.final_dir)
    assert fa.keys() == fb.keys()
    for key in fa:
        assert torch.equal(fa[key], fb[key]), key


def test_learns_an_easy_task(tmp_path):
    """One-token replies rewarded for containing "e" (about half of them at first); full fine-tuning
    with a high learning rate concentrates the policy on rewarded tokens within a few steps."""
    cfg = _config(tmp_path / "run", "lora.enabled=false", "optim.lr=0.1", "env.options.letter=e", "env.options.max_turns=1",
                  "rollout.max_turns=1", "rollout.max_tokens_per_turn=1", "tasks_per_step=2", "group_size=16",
                  "tasks.train=16", "tasks.test=8", "eval.every=0", "eval.samples_per_task=4", "steps=10",
                  "save_rollouts=false")
    result = train_rl(cfg)
    rows = read_metrics(result.run_dir)
    rewards = [r["reward/mean"] for r in rows[1:]]
    entropy = [r["train/entropy"] for r in rows[1:] if "train/entropy" in r]  # steps that trained
    print("rewards", rewards, "eval", rows[0]["eval/pass@1"], rows[-1]["eval/pass@1"], entropy)
    assert 0.2 < rewards[0] < 0.8, rewards  # the random policy: about half
    assert sum(rewards[-3:]) / 3 >= 0.85, rewards
    assert rows[0]["eval/pass@1"] < 0.75 and rows[-1]["eval/pass@1"] >= 0.85, (rows[0], rows[-1])
    # the policy has concentrated (steps whose groups are all rewarded do not train, so the last
    # trained step may come right before the big drop: look at the lowest)
    assert min(entropy) < 0.9 * entropy[0], entropy


def test_micro_batch_size_does_not_change_the_logged_step(tmp_path):
    common = ("steps=1", "ppo_epochs=2", "policy_loss.kl_coef=0.1", "lora.enabled=false", "optim.lr=1e-2",
              "eval.every=0", "tasks.test=1", "eval.at_start=false")
    one = _steps(train_rl(_config(tmp_path / "m1", *common, "micro_batch_size=1")).run_dir)[0]
    big = _steps(train_rl(_config(tmp_path / "m8", *common, "micro_batch_size=64")).run_dir)[0]
    # parts cut by computed tokens (a shared prompt counted once): the same step again
    by_tokens = _steps(train_rl(_config(tmp_path / "mt", *common, "micro_batch_tokens=48")).run_dir)[0]
    assert one["examples/count"] == big["examples/count"] == by_tokens["examples/count"] > 1
    for key in ("train/loss", "train/grad_norm", "train/ratio_min", "train/ratio_max", "train/ratio_mean",
                "train/entropy", "train/kl_ref", "train/clip_frac"):
        # the ratios are read after the first epoch's step (full fine-tuning at lr 1e-2), which
        # magnifies the float rounding of another micro-batch split about tenfold
        rel = 1e-3 if key.startswith("train/ratio") else 1e-4
        assert one[key] == pytest.approx(big[key], rel=rel, abs=1e-6), key
        assert one[key] == pytest.approx(by_tokens[key], rel=rel, abs=1e-6), key


def test_temperature_below_one_keeps_the_first_pass_on_policy(tmp_path):
    """The trainer scores tokens at the sampling temperature, so the engine's log-probs are the old
    policy's: ratio exactly 1, nothing clipped (at temperature 1 the scores would differ by ~x/T)."""
    row = _steps(train_rl(_config(tmp_path / "run", "rollout.temperature=0.5", "steps=1", "eval.at_start=false",
                                  "eval.every=0", "tasks.test=1")).run_dir)[0]
    assert row["train/ratio_min"] == pytest.approx(1.0, abs=1e-4) and row["train/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert row["train/clip_frac"] == 0.0


def test_gradient_checkpointing_recomputes_and_changes_nothing(tmp_path, monkeypatch):
    # Count MLP forwards with grad on (the decoder layer's own forward is the checkpointing wrapper).
    from transformers.models.llama.modeling_llama import LlamaMLP

    calls = {"n": 0}
    real_forward = LlamaMLP.forward

    def counted(self, *args, **kwargs):
        if torch.is_grad_enabled():
            calls["n"] += 1
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaMLP, "forward", counted)
    # one forward per micro-batch on both sides (the shared-prefix forward, which checkpointing
    # cannot use, would split the plain side's into two calls)
    monkeypatch.setattr("tracegym.train.step_prefix.MIN_SHARED_PREFIX", 10**9)  # micro-batch and step prefixes alike
    common = ("steps=1", "eval.at_start=false", "eval.every=0", "tasks.test=1", "lora.enabled=false")
    plain = _steps(train_rl(_config(tmp_path / "a", *common)).run_dir)[0]
    plain_calls, calls["n"] = calls["n"], 0
    checkpointed = _steps(train_rl(_config(tmp_path / "b", *common, "model.gradient_checkpointing=true")).run_dir)[0]
    assert plain_calls > 0 and calls["n"] == 2 * plain_calls  # every layer runs again in the backward pass
    for key in ("train/loss", "train/grad_norm", "reward/mean"):
        assert checkpointed[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize(
    "override, named, nearest",
    [
        ("policy_loss.clip_eps=0.2", "policy_loss.clip_eps", "policy_loss.clip_eps_low"),
        ("group_sise=4", "group_sise", "group_size"),
        ("rollout.max_turn=2", "rollout.max_turn", "rollout.max_turns"),
    ],
)
def test_bad_config_key_exits_2_naming_the_nearest_key(tmp_path, capsys, override, named, nearest):
    from tracegym.cli import main

    config = tmp_path / "rl.yaml"
    config.write_text(f"model: {{name: tiny-random}}\noutput_dir: '{tmp_path / 'run'}'\n")
    assert main(["rl", "--config", str(config), override]) == 2
    err = capsys.readouterr().err
    assert f"unknown key '{named}'" in err and f"did you mean '{nearest}'?" in err, err
    assert not (tmp_path / "run").exists()  # rejected before anything is written


def test_bad_policy_loss_value_exits_2(tmp_path, capsys):
    from tracegym.cli import main

    config = tmp_path / "rl.yaml"
    config.write_text("model: {name: tiny-random}\npolicy_loss: {loss: ppo, clip_eps_low: 2}\n")
    assert main(["rl", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "'policy_loss.loss'" in err and "ppo_clip" in err and "'policy_loss.clip_eps_low'" in err, err


def test_an_engine_without_sampled_logprobs_is_refused(tmp_path):
    cfg = _config(tmp_path / "run", "rollout.engine=openai", "rollout.engine_options={base_url: 'http://127.0.0.1:9/v1'}",
                  "eval.at_start=false")
    with pytest.raises(ValueError, match="does not return the log-probs"):
        train_rl(cfg)


def test_gigpo_runs_from_the_cli_and_logs_its_step_group_size(tmp_path, capsys):
    from tracegym.cli import main

    config = tmp_path / "rl.yaml"
    config.write_text(
        "model: {name: tiny-random}\nlora: {r: 4}\nenv: {name: frozenlake, options: {size: 3, hole_fraction: 0.0}}\n"
        "tasks: {train: 2, test: 1}\ntasks_per_step: 1\ngroup_size: 4\n"
        "rollout: {max_turns: 3, max_tokens_per_turn: 4, concurrency: 8}\nsteps: 1\nskip_uniform_groups: false\n"
        "eval: {at_start: false, every: 0}\nsave_rollouts: false\n"
        f"output_dir: '{tmp_path / 'run'}'\nlogging: {{progress: false, tensorboard: false}}\n"
    )
    assert main(["rl", "--config", str(config), "advantage.estimator=gigpo", "advantage.options.gamma=0.9"]) == 0
    row = read_metrics(tmp_path / "run")[-1]
    # four samples of one task start on the same board: the first turns share a step group
    assert row["advantage/step_group_size"] >= 2.0 and 0 < row["advantage/step_group_shared"] <= 1
    assert row["examples/count"] == 4.0


def test_info_gain_scores_turns_and_trains(tmp_path):
    # LetterEnv asks again after a miss: two-turn episodes, so the first turn gets an info-gain score
    cfg = _config(tmp_path / "run", "advantage.estimator=info_gain", "advantage.intrinsic=info_gain", "steps=1",
                  "eval.at_start=false", "eval.every=0", "tasks.test=1")
    (row,) = _steps(train_rl(cfg).run_dir)
    assert row["advantage/info_gain_abs_mean"] > 0 and 0 < row["advantage/gate_mean"] < 1
    assert row["examples/count"] > 0 and row["train/grad_norm"] > 0
    with pytest.raises(Exception, match="intrinsic: info_gain"):
        _config(tmp_path / "bad", "advantage.estimator=info_gain")


def test_mc_continuation_branches_and_trains(tmp_path):
    cfg = _config(tmp_path / "run", "advantage.estimator=mc_continuation", "advantage.intrinsic=mc_continuation",
                  "advantage.mc_k=2", "advantage.mc_m=1", "advantage.mc_decision_turns=first", "steps=1",
                  "advantage.mc_reach=replay",  # LetterEnv has no snapshot/restore but is deterministic
                  "eval.at_start=false", "eval.every=0", "tasks.test=1", "tasks_per_step=2")
    (row,) = _steps(train_rl(cfg).run_dir)
    # every trajectory (2 tasks x 4) branches at its first turn: 2 actions x 1 continuation each
    assert row["advantage/mc_decision_points"] == 8.0 and row["advantage/mc_scored"] == 8.0
    assert row["advantage/mc_continuations"] == 16.0 and row["advantage/mc_failed_continuations"] == 0.0
    assert row["examples/count"] == 8.0 and row["train/grad_norm"] > 0  # the scored turns carry signal
