"""Learning that holds (docs/algorithms.md, "Why RL lost the strong start"): over-long episodes leave
before advantages (kept groups sum to 0), LUFFY guidance for all-failure groups, the drift measure
and its cap, the probe set, health rows and the temperatures in every row."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tracegym.algos import estimate
from tracegym.batch import examples_from_groups
from tracegym.config import GuidanceConfig, RLConfig, load_config
from tracegym.recipes.rl import train_rl
from tracegym.rl.collect import drop_overlong
from tracegym.train.guidance import GUIDANCE_KEY, add_guidance, needs_guidance, shaping_weight
from tracegym.train.logging import read_metrics
from tracegym.types import Message, Trajectory, TrajectoryGroup, Turn


def _turn(prompt: int, completion: int, reward: float = 0.0) -> Turn:
    return Turn(prompt_ids=tuple(range(1, prompt + 1)), completion_ids=tuple(range(100, 100 + completion)),
                completion_logprobs=(-0.5,) * completion, message=Message(role="assistant", content="x"), reward=reward)


def _episode(task: str, index: int, reward: float, completion: int = 3) -> Trajectory:
    return Trajectory(env="t", task_id=task, sample_index=index, messages=(Message(role="user", content="q"),),
                      turns=(_turn(4, completion, reward),), reward=reward, success=reward >= 1.0)


class _Renderer:
    """Enough of a renderer for ``examples_from_groups``: the default token-exact example builder."""

    def build_examples(self, trajectory: Trajectory, weight: Any = 1.0, advantage: Any = 0.0, stats: Any = None) -> list:
        from tracegym.render.trajectory_examples import build_examples

        return build_examples(trajectory, weight=weight, advantage=advantage, stats=stats)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_kept_groups_sum_to_zero_after_every_filter(estimator):
    # task a: one long failure (dropped for length) among three; task b: all long (the group goes);
    # task c: uniform (skipped). Before the fix the long failure was dropped after estimation.
    groups = [
        TrajectoryGroup(env="t", task_id="a", trajectories=(
            _episode("a", 0, 1.0), _episode("a", 1, 0.0), _episode("a", 2, 0.0, completion=40))),
        TrajectoryGroup(env="t", task_id="b", trajectories=(_episode("b", 0, 0.0, 40), _episode("b", 1, 1.0, 40))),
        TrajectoryGroup(env="t", task_id="c", trajectories=(_episode("c", 0, 1.0), _episode("c", 1, 1.0))),
    ]
    tasks = [type("T", (), {"id": name})() for name in "abc"]
    kept, kept_tasks, dropped = drop_overlong(groups, tasks, _Renderer(), max_length=20)
    assert dropped == 3 and [g.task_id for g in kept] == ["a", "c"] and [t.id for t in kept_tasks] == ["a", "c"]
    advantages = estimate(estimator, kept).advantages
    data = examples_from_groups(kept, _Renderer(), advantages, max_length=20,
                                skip_groups=[not any(a for turns in g for a in turns) for g in advantages])
    assert data.dropped_too_long == 0  # nothing left to drop after the estimator
    per_group: dict[int, float] = {}
    for example, g in zip(data.examples, data.group_index):
        sampled = [a for a, m in zip(example.advantages, example.loss_mask) if m]
        per_group[g] = per_group.get(g, 0.0) + sampled[0]  # one advantage per (single-turn) episode
    assert set(per_group) == {0} and per_group[0] == pytest.approx(0.0, abs=1e-6)


def test_guidance_gives_the_expert_a_positive_advantage_and_the_failures_negative_ones():
    failures = tuple(_episode("a", i, 0.0) for i in range(3))
    groups = [TrajectoryGroup(env="t", task_id="a", trajectories=failures),
              TrajectoryGroup(env="t", task_id="b", trajectories=(_episode("b", 0, 1.0), _episode("b", 1, 0.0)))]
    assert needs_guidance(groups, GuidanceConfig()) == [0]  # only the all-failure group
    assert needs_guidance(groups, GuidanceConfig(groups="every")) == [0, 1]  # LUFFY's mixed-policy setting
    assert needs_guidance(groups, GuidanceConfig(groups="every", max_groups_per_step=1)) == [0]
    expert = _episode("a", 0, 1.0).model_copy(update={"policy": "expert"})
    guided, count = add_guidance(groups, {"a": expert})
    assert count == 1 and len(guided[0].trajectories) == 4 and guided[1] is groups[1]
    assert guided[0].trajectories[-1].info[GUIDANCE_KEY] is True and guided[0].trajectories[-1].sample_index == 3
    advantages = estimate("grpo", guided).advantages[0]
    assert advantages[3][0] > 0 and all(a[0] < 0 for a in advantages[:3])
    assert sum(a[0] for a in advantages) == pytest.approx(0.0, abs=1e-9)
    # in a group that has a success, the guide (reward 1) still gets a positive advantage
    both, count = add_guidance(groups, {"a": expert, "b": expert.model_copy(update={"task_id": "b"})}, [0, 1])
    mixed = estimate("grpo", both).advantages[1]
    assert count == 2 and len(both[1].trajectories) == 3 and mixed[2][0] > 0 and mixed[1][0] < 0
    assert sum(a[0] for a in mixed) == pytest.approx(0.0, abs=1e-9)
    # a failed guide is not added: an all-failure group stays without signal
    assert add_guidance(groups, {"a": _episode("a", 0, 0.0)})[1] == 0


def test_luffy_shaping_weight_hand_values():
    gamma = 0.1
    p = torch.tensor([0.1, 1.0, 1e-4])
    expected = [gamma * 0.1 / 0.2 ** 2, gamma / 1.1 ** 2, gamma * 1e-4 / (1e-4 + gamma) ** 2]  # 0.25, 0.0826, ~1e-3
    assert shaping_weight(p.log(), gamma).tolist() == pytest.approx(expected, rel=1e-5)
    # the shaped gradient gamma p / (p + gamma)^2 is largest at p = gamma (1/4)
    grid = torch.linspace(1e-3, 1.0, 1000)
    assert float(grid[shaping_weight(grid.log(), gamma).argmax()]) == pytest.approx(gamma, abs=2e-3)


def _calc_config(out: Path, *overrides: str) -> RLConfig:
    data = {
        "model": {"name": "tiny-random"}, "lora": {"enabled": True, "r": 4}, "optim": {"lr": 1e-2},
        "env": {"name": "calculator", "options": {"num_calls": 2}}, "tasks": {"train": 4, "test": 0, "seed": 0},
        "tasks_per_step": 2, "group_size": 2, "micro_batch_size": 4, "steps": 2,
        "rollout": {"max_turns": 3, "max_tokens_per_turn": 6, "concurrency": 8, "temperature": 0.7},
        "health": {"probe_tasks": 2, "drift_rows": 4, "mi_max_pairs": 2},
        "output_dir": str(out), "logging": {"progress": False, "tensorboard": False},
    }
    return load_config(RLConfig, data=data, overrides=list(overrides))


def test_guided_run_trains_on_the_expert_and_logs_health_drift_and_temperatures(tmp_path):
    # A random model never solves a calculator task: without guidance every group is uniform and
    # skipped; with it, each group gets the expert's trajectory and the step trains on it.
    result = train_rl(_calc_config(tmp_path / "run", "guidance.max_groups_per_step=2"))
    rows = read_metrics(result.run_dir)
    assert rows[0]["rollout/temperature"] == 0.7 and "eval/temperature" in rows[0]
    assert math.isfinite(rows[0]["drift/probe_nll"]) and rows[0]["drift/probe_nll"] > 0
    for row in rows[1:]:
        assert row["guidance/groups"] == 2.0 and row["groups/no_signal"] == 0.0
        # the groups carry signal through the guide, but the policy's own samples all failed: the
        # echo-trap monitor sees that (guides are left out of health/*)
        assert row["health/informative_groups"] == 2.0 and row["health/reward_std"] == 0.0
        assert row["success_rate"] == 0.0 and row["guidance/unsolved"] == 0.0
        assert row["examples/count"] == 6.0  # 2 groups x (2 samples + the expert)
        assert row["drift/kl"] > 0 and math.isfinite(row["drift/probe_nll"])
        assert "health/mi" in row and row["train/grad_norm"] > 0  # without guidance: 0 (all groups uniform)


def test_drift_cap_undoes_a_step_beyond_the_bound(tmp_path):
    from safetensors.torch import load_file

    capped = train_rl(_calc_config(tmp_path / "capped", "guidance.max_groups_per_step=2", "steps=1",
                                   "max_policy_drift=1e-12", "health.probe_tasks=0"))
    row = read_metrics(capped.run_dir)[-1]
    assert row["drift/kl_full"] > 1e-12 and row["drift/step_scale"] == 0.0 and row["drift/kl"] == 0.0
    # undone: the final adapter is the untrained one (LoRA B starts at 0, so every lora_B is 0 again)
    weights = load_file(str(capped.final_dir / "adapter_model.safetensors"))
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b and all(float(w.abs().max()) == 0.0 for w in lora_b)
    loose = train_rl(_calc_config(tmp_path / "loose", "guidance.max_groups_per_step=2", "steps=1",
                                  "max_policy_drift=1e6", "health.probe_tasks=0"))
    row = read_metrics(loose.run_dir)[-1]
    assert row["drift/step_scale"] == 1.0 and row["drift/kl"] == row["drift/kl_full"] > 0


def test_replay_examples_rotate_through_the_pool_by_step():
    from tracegym.rl.collect import replay_examples

    pool = [["a1", "a2"], ["b"], ["c"]]
    assert replay_examples(pool, 1, 2) == ["a1", "a2", "b"]
    assert replay_examples(pool, 2, 2) == ["c", "a1", "a2"]  # around the end; a function of the step alone
    assert replay_examples([], 5, 2) == []


def test_expert_replay_alone_moves_the_policy_toward_the_expert(tmp_path):
    # A random model never solves a task, so every advantage is 0 (groups kept, not skipped): the
    # policy-gradient term is exactly zero and only the expert's NLL can move the weights.
    common = ("skip_uniform_groups=false", "steps=3", "health.probe_tasks=2")
    plain = read_metrics(train_rl(_calc_config(tmp_path / "plain", *common)).run_dir)
    assert all(row["train/grad_norm"] == 0.0 for row in plain[1:]) and "train/replay_nll" not in plain[-1]
    # (a rate Adam does not overshoot with on this tiny model: 1e-2 oscillates)
    replayed = read_metrics(train_rl(_calc_config(tmp_path / "replay", *common, "optim.lr=1e-3", "expert_replay.coef=1.0",
                                                  "expert_replay.tasks=4", "expert_replay.per_step=4")).run_dir)
    assert all(row["train/grad_norm"] > 0 for row in replayed[1:])
    # the expert's NLL (measured in each update, before its step) and the probe's (after it) both fall
    nll = [row["train/replay_nll"] for row in replayed[1:]]
    probe = [row["drift/probe_nll"] for row in replayed]
    assert nll == sorted(nll, reverse=True) and nll[-1] < nll[0]
    assert probe == sorted(probe, reverse=True) and probe[-1] < probe[0]


def test_expert_replay_is_refused_for_teams():
    with pytest.raises(ValueError, match="expert_replay"):
        RLConfig.model_validate({"model": {"name": "tiny-random"}, "env": {"name": "calc_relay"}, "lora": {"enabled": True},
                                 "roles": {"a": {}, "b": {}}, "expert_replay": {}})


def test_replay_only_steps_on_the_expert_nll_alone():
    # expert_replay.policy_gradient=false (the control of the strong-start bench): the update equals a
    # step on the replay NLL by itself, whatever the sampled batch's advantages; with the policy term
    # on, the same call moves the weights elsewhere.
    from tracegym.algos.config import PolicyLossConfig
    from tracegym.batch import make_batch
    from tracegym.models import load
    from tracegym.train.policy_update import policy_update, replay_nll_backward, score_batch
    from tracegym.types import TrainingExample

    def rows(start: int, advantage: float) -> Any:
        ids = [list(range(start, start + 10)), list(range(start + 50, start + 57))]
        masks = [[0] * 4 + [1] * 6, [0] * 3 + [1] * 4]
        return make_batch([TrainingExample(input_ids=i, loss_mask=m, weights=[1.0] * len(i), advantages=[advantage] * len(i),
                                           logprobs=[0.0] * len(i), source=f"e/t{n}/0") for n, (i, m) in enumerate(zip(ids, masks))],
                          pad_token_id=0)

    loss_cfg = PolicyLossConfig(loss="ppo_clip")
    replay = rows(300, 0.0)

    def step(policy_gradient: bool | None) -> dict[str, torch.Tensor]:
        model = load("tiny-random")[0]
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        if policy_gradient is None:  # by hand: the replay term, then the same step
            optimizer.zero_grad(set_to_none=True)
            replay_nll_backward(model, replay, 1.0, micro_batch_size=1)
            optimizer.step()
        else:
            batch = score_batch(model, None, rows(100, 2.0), loss_cfg, micro_batch_size=1, temperature=1.0, epochs=1)
            metrics = policy_update(model, batch, loss_cfg, optimizer, scheduler, epochs=1, micro_batch_size=1, temperature=1.0,
                                    max_grad_norm=None, replay=(replay, 1.0), policy_gradient=policy_gradient)
            assert ("train/loss" in metrics) == policy_gradient and metrics["train/replay_nll"] > 0
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    by_hand, replay_only, both = step(None), step(False), step(True)
    assert all(torch.equal(by_hand[k], replay_only[k]) for k in by_hand)
    assert any(not torch.equal(by_hand[k], both[k]) for k in by_hand)


def test_replay_only_is_the_demo_control_of_replay():
    from tracegym.recipes.demo import DemoConfig, rl_stage_config

    control = rl_stage_config(DemoConfig(rl_expert_replay=1.0, rl_replay_only=True), "a", "b")
    assert control.expert_replay is not None and control.expert_replay.policy_gradient is False
    with pytest.raises(ValueError, match="rl_replay_only: set rl_expert_replay"):
        DemoConfig(rl_replay_only=True, rl_expert_replay=0.0)
