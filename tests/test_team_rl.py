"""Team episodes and team RL on the tiny random model: every role's turns share engine batches with
per-row adapters, per-role trajectories share an episode id, a step trains only the adapters that
train, resume is exact, a shared adapter is one policy, failures stay in their episode, and the
team envs run end to end with their scripted experts.

``LetterTeam`` (defined here): alice and bob reply once each (alice first on even tasks, bob first on
odd ones, so one engine batch holds both roles); the team is rewarded when alice's reply contains
"m" and bob's contains "e" (a random model's few-token replies hit each often enough that groups
carry signal)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from tracegym.config import RLConfig, load_config
from tracegym.envs import register, unregister
from tracegym.envs.base import Task
from tracegym.envs.episode import message_policy
from tracegym.envs.team import TeamEnv, TeamStep, play_team_episode
from tracegym.commands.rl import train_any_rl
from tracegym.render import get_renderer
from tracegym.rollout import RolloutConfig
from tracegym.rollout.team import group_by_role, run_team_rollouts_sync
from tracegym.train.logging import read_metrics
from tracegym.types import Message

NON_DETERMINISTIC = ("time", "rss_mb", "time/", "rollout/tokens_per_s", "train/tokens_per_s")


class LetterTeam(TeamEnv):
    name = "test-letter-team"
    roles = ("alice", "bob")

    def __init__(self, fail_on: str | None = None):
        self.fail_on = fail_on
        self.said: dict[str, str] = {}
        self.task: Task | None = None

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        offset = 0 if split == "train" else 10_000
        return [Task(id=f"{split}-{seed}-{i}", split=split, data={"word": f"w{offset + i}", "bob_first": i % 2 == 1})
                for i in range(n)]

    def tool_schemas(self, role: str) -> list[dict[str, Any]]:
        return []

    async def reset(self, task: Task) -> dict[str, list[Message]]:
        self.task, self.said = task, {}
        return {role: [Message(role="system", content=f"You are {role}. Reply with one word."),
                       Message(role="user", content=f"Word {task.data['word']}")] for role in self.roles}

    def next_role(self) -> str | None:
        assert self.task is not None
        order = self.roles[::-1] if self.task.data["bob_first"] else self.roles
        return next((r for r in order if r not in self.said), None)

    async def step(self, role: str, message: Message, parse_errors: Sequence[str] = ()) -> TeamStep:
        assert self.task is not None
        if self.fail_on is not None and self.task.id == self.fail_on:
            raise RuntimeError("injected env failure")
        self.said[role] = message.content
        partner = "bob" if role == "alice" else "alice"
        if len(self.said) == 1:
            return TeamStep(views={partner: (Message(role="user", content=f"{role} says: {message.content}"),)})
        win = "m" in self.said["alice"] and "e" in self.said["bob"]
        return TeamStep(reward=float(win), terminated=True, info={"success": win})

    def expert_action(self, role: str) -> Message:
        return Message(role="assistant", content="m" if role == "alice" else "e")


@pytest.fixture(autouse=True, scope="module")
def letter_team():
    register("test-letter-team", LetterTeam, overwrite=True)
    yield
    unregister("test-letter-team")


def _config(out: Path, *overrides: str, roles: dict | None = None) -> RLConfig:
    data = {
        "model": {"name": "tiny-random"},
        "lora": {"enabled": True, "r": 4},
        "optim": {"lr": 2e-3},
        "env": {"name": "test-letter-team"},
        "roles": roles if roles is not None else {"alice": {}, "bob": {}},
        "advantage": {"estimator": "magrpo"},
        "tasks": {"train": 6, "test": 2, "seed": 0},
        "tasks_per_step": 3,
        "group_size": 4,
        "rollout": {"max_turns": 2, "max_tokens_per_turn": 3, "temperature": 1.0, "concurrency": 16},
        "steps": 2,
        "micro_batch_size": 8,
        "eval": {"every": 0, "samples_per_task": 2, "at_start": False},
        "checkpoint": {"every": 1},
        "logging": {"progress": False},
        "output_dir": str(out),
    }
    return load_config(RLConfig, data=data, overrides=list(overrides))


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) > 0]
    return [{k: v for k, v in r.items() if not any(k.startswith(p) or k == p for p in NON_DETERMINISTIC)} for r in rows]


def _adapter_tensors(final: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(final / name / "adapter_model.safetensors"))


def test_team_episode_gives_per_role_trajectories_with_one_episode_id():
    env = LetterTeam()
    task = env.tasks("test", 1)[0]
    trajectories = asyncio.run(play_team_episode(
        LetterTeam, task, lambda e: {r: message_policy(lambda r=r: e.expert_action(r)) for r in e.roles}))
    assert [t.info["role"] for t in trajectories] == ["alice", "bob"]
    assert len({t.info["episode_id"] for t in trajectories}) == 1
    assert all(t.reward == 1.0 and t.success for t in trajectories)
    alice, bob = trajectories
    # partial views: bob is told what alice said, alice never sees bob's message
    assert any(m.content == "alice says: m" for m in bob.messages)
    assert not any(m.role == "assistant" and m.content == "e" for m in alice.messages)


def test_env_failure_fails_only_its_episode(tokenizer):
    renderer = get_renderer("smollm2-135m", tokenizer)
    tasks = LetterTeam().tasks("train", 3)
    result = run_team_rollouts_sync(lambda: LetterTeam(fail_on=tasks[1].id), tasks, "expert", renderer,
                                    RolloutConfig(max_turns=2, samples_per_task=2, on_env_error="exclude"))
    assert result.stats.failed == 2 and result.stats.kept == 4
    assert {t.task_id for t in result.failed} == {tasks[1].id}
    assert all(t.reward == 1.0 for t in result.trajectories)
    assert len(group_by_role(result.trajectories)) == 4  # (2 tasks) x (2 roles)


def test_roles_sample_in_the_same_engine_calls_with_their_adapters(tmp_path, monkeypatch):
    from tracegym.engines.hf import HFEngine

    calls: list[list[str] | None] = []
    original = HFEngine.generate

    def spy(self, prompts, params, adapters=None):
        calls.append(None if adapters is None else list(adapters))
        return original(self, prompts, params, adapters=adapters)

    monkeypatch.setattr(HFEngine, "generate", spy)
    train_any_rl(_config(tmp_path / "run", "steps=1"))
    assert calls and all(c is not None for c in calls)
    assert any(set(c) == {"alice", "bob"} for c in calls), calls  # mixed-role batches happened
    assert max(len(c) for c in calls) > 4


def test_team_run_trains_each_adapter_and_writes_per_role_folders(tmp_path):
    result = train_any_rl(_config(tmp_path / "run", roles={"alice": {}, "bob": {"train": False}}))
    final = result.final_dir
    assert final is not None and (final / "team.json").is_file()
    rows = [r for r in read_metrics(tmp_path / "run") if r.get("step", 0) > 0]
    assert "adapter/alice/train/loss" in rows[-1] and "adapter/bob/train/loss" not in rows[-1]
    assert {"role/alice/reward", "role/bob/reward", "reward/mean"} <= set(rows[-1])
    # bob is frozen: its adapter is exactly the fresh one (B = 0); alice's moved
    bob = _adapter_tensors(final, "bob")
    assert all(torch.count_nonzero(v) == 0 for k, v in bob.items() if "lora_B" in k)
    alice = _adapter_tensors(final, "alice")
    assert any(torch.count_nonzero(v) > 0 for k, v in alice.items() if "lora_B" in k)
    # each folder is a portable adapter of its own
    from tracegym.models import load

    model, _ = load(str(final / "alice"))
    assert model is not None


def test_shared_adapter_is_one_policy(tmp_path):
    result = train_any_rl(_config(tmp_path / "run", "steps=1", roles={"alice": {"adapter": "team"}, "bob": {"adapter": "team"}}))
    assert sorted(p.name for p in result.final_dir.iterdir() if p.is_dir()) == ["team"]
    row = [r for r in read_metrics(tmp_path / "run") if r.get("step", 0) > 0][-1]
    assert row["adapter/team/examples"] > 0 and "role/alice/reward" in row


def test_team_resume_matches_straight_run_exactly(tmp_path):
    straight = train_any_rl(_config(tmp_path / "a", "steps=3"))
    stopped = train_any_rl(_config(tmp_path / "b", "steps=3"), stop_at_step=1)
    assert stopped.final_dir is None and stopped.step == 1
    resumed = train_any_rl(_config(tmp_path / "b", "steps=3"), resume=True)
    assert _rows(tmp_path / "a") == _rows(tmp_path / "b")
    for name in ("alice", "bob"):
        a, b = _adapter_tensors(straight.final_dir, name), _adapter_tensors(resumed.final_dir, name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_mistakes_are_named(tmp_path):
    with pytest.raises(ValueError, match="has roles"):
        train_any_rl(_config(tmp_path / "r1", roles={"alice": {}, "carol": {}}))
    with pytest.raises(ValueError, match="not a team env"):
        train_any_rl(_config(tmp_path / "r2", "env.name=calculator", roles={"alice": {}}))
    with pytest.raises(ValueError, match="lora.enabled"):
        _config(tmp_path / "r3", "lora.enabled=false")


@pytest.mark.parametrize("env", ["calc_relay", "logic_grid"])
def test_builtin_team_envs_run_with_the_expert_team(env, tokenizer):
    from tracegym.envs import make

    renderer = get_renderer("smollm2-135m", tokenizer)
    tasks = make(env).tasks("test", 6)
    result = run_team_rollouts_sync(env, tasks, "expert", renderer, RolloutConfig(max_turns=8))
    assert result.stats.success_rate == 1.0 and result.stats.failed == 0
    # the expert's turns are token data (SFT-ready), per role
    roles = {t.info["role"] for t in result.trajectories}
    assert roles == set(make(env).roles) and all(t.turns for t in result.trajectories)


def _selfplay_config(out: Path, *overrides: str) -> RLConfig:
    data = {
        "model": {"name": "tiny-random"},
        "lora": {"enabled": True, "r": 4},
        "optim": {"lr": 1e-3},
        "env": {"name": "calc_proposer", "options": {"num_calls": 1}},
        "roles": {"proposer": {}, "solver": {}},
        "selfplay": {"solver_env": "calculator", "solver_env_options": {"num_calls": 1}, "solver_attempts": 2},
        "tasks": {"train": 4, "test": 2, "seed": 0},
        "tasks_per_step": 2,
        "group_size": 2,
        "rollout": {"max_turns": 2, "max_tokens_per_turn": 4, "temperature": 1.0},
        "steps": 2,
        "eval": {"every": 0, "samples_per_task": 1, "at_start": False},
        "checkpoint": {"every": 1},
        "logging": {"progress": False},
        "output_dir": str(out),
    }
    return load_config(RLConfig, data=data, overrides=list(overrides))


def test_selfplay_loop_runs_on_the_calculator(tmp_path, monkeypatch):
    """A random proposer proposes nothing valid; with valid proposals injected (the proposer env's
    expert), the solver attempts them and the proposer is paid 4p(1-p)."""
    from tracegym.environments.calc_proposer import CalcProposerEnv
    from tracegym.recipes import selfplay

    result = train_any_rl(_selfplay_config(tmp_path / "random"))
    rows = [r for r in read_metrics(tmp_path / "random") if r.get("step", 0) > 0]
    assert rows[-1]["proposer/valid_rate"] == 0.0 and rows[-1]["proposer/reward"] == 0.0
    assert (result.final_dir / "proposer").is_dir() and (result.final_dir / "solver").is_dir()

    # every other proposal is replaced by the expert's valid one: the solver then plays them
    original = CalcProposerEnv.solver_task_from
    expert = CalcProposerEnv()

    def solver_task_from(self, messages, task_id):
        index = int(task_id.rsplit("-", 1)[1])
        if index % 2:
            return None
        seed = expert.tasks("train", 4, 0)[0]
        asyncio.run(expert.reset(seed))
        call = expert.expert_action().tool_calls[0]
        return original(self, [Message(role="assistant", tool_calls=(call.model_copy(update={"id": "c0"}),)),
                               Message(role="tool", content="Accepted.", tool_call_id="c0", name="propose")], task_id)

    monkeypatch.setattr(CalcProposerEnv, "solver_task_from", solver_task_from)
    seen: dict[str, Any] = {}
    real = selfplay.proposer_rewards

    def spy(valid, rates):
        out = real(valid, rates)
        seen.setdefault("calls", []).append((list(valid), list(rates), out))
        return out

    monkeypatch.setattr(selfplay, "proposer_rewards", spy)
    train_any_rl(_selfplay_config(tmp_path / "injected", "steps=1"))
    row = [r for r in read_metrics(tmp_path / "injected") if r.get("step", 0) > 0][-1]
    assert row["proposer/valid_rate"] == 0.5
    valid, rates, rewards = seen["calls"][0]
    assert valid == [True, False] and rates[0] is not None and rates[1] is None
    assert rewards == [4 * rates[0] * (1 - rates[0]), 0.0]


def test_hierarchical_and_magrpo_values():
    from tracegym.algos import estimate, hierarchical_advantages, learnability_reward
    from tracegym.types import Trajectory, TrajectoryGroup, Turn

    assert hierarchical_advantages([[1, 1, 0]])[0] == pytest.approx([1 / 3, 1 / 3, -2 / 3])
    assert [learnability_reward(True, p) for p in (0.0, 0.25, 0.5, 1.0)] == [0.0, 0.75, 1.0, 0.0]
    assert learnability_reward(False, 0.5) == 0.0

    def traj(role: str, reward: float, i: int) -> Trajectory:
        turn = Turn(prompt_ids=(1,), completion_ids=(2,), message=Message(role="assistant", content="x"))
        last = turn.model_copy(update={"reward": reward})  # a role's reward is credited on its last turn
        return Trajectory(env="e", task_id="t", sample_index=i, messages=(), turns=(turn, last), reward=reward,
                          info={"role": role, "episode_id": str(i)})

    groups = [TrajectoryGroup(env="e", task_id=f"t@{role}", trajectories=tuple(traj(role, r, i) for i, r in enumerate(rs)))
              for role, rs in (("planner", [1, 0, 0, 1]), ("solver", [1, 0, 0, 0]))]
    adv = estimate("magrpo", groups).advantages
    assert adv[0] == [[0.5, 0.5], [-0.5, -0.5], [-0.5, -0.5], [0.5, 0.5]]
    assert adv[1] == [[0.75, 0.75], [-0.25, -0.25], [-0.25, -0.25], [-0.25, -0.25]]
    mixed = [TrajectoryGroup(env="e", task_id="t", trajectories=(traj("planner", 1, 0), traj("solver", 0, 1)))]
    with pytest.raises(ValueError, match="mixes roles"):
        estimate("magrpo", mixed)


def test_hierarchical_advantages_zero_equal_groups_exactly_and_refuse_nan():
    from tracegym.algos import has_signal, hierarchical_advantages, learnability_reward

    # equal learnability rewards (e.g. 4 p (1 - p) of pass rates k/10) whose float mean is not the value itself used
    # to give ~1e-16 advantages, which has_signal counts as signal
    values = sorted({learnability_reward(True, k / 10) for k in range(11)})
    for value in values:
        for size in range(1, 13):
            (advantages,) = hierarchical_advantages([[value] * size])
            assert advantages == [0.0] * size, (value, size, advantages)
            assert not has_signal([advantages])
    assert hierarchical_advantages([[0.1 + 0.2, 0.3, 0.3]]) == [[0.0, 0.0, 0.0]]  # equal up to rounding
    assert hierarchical_advantages([[], [1.0, 0.0]]) == [[], [0.5, -0.5]]
    with pytest.raises(ValueError, match=r"group 1 has non-finite rewards at positions \[2\]"):
        hierarchical_advantages([[1.0, 0.0], [0.5, 0.25, float("nan")]])
    with pytest.raises(ValueError, match="group 0 has non-finite"):
        hierarchical_advantages([[float("inf"), 0.0]])


def test_selfplay_reward_replacement_keeps_the_episode_reward_the_sum_of_the_turn_rewards():
    from tracegym.algos import episode_reward_problems
    from tracegym.recipes.selfplay import _with_reward
    from tracegym.types import Trajectory, TrajectoryGroup, Turn

    turns = tuple(Turn(prompt_ids=(1,), completion_ids=(2,), message=Message(role="assistant"), reward=r) for r in (0.5, 0.25))
    proposal = _with_reward(Trajectory(env="e", task_id="t", messages=(), turns=turns, reward=0.75), 0.96)
    # the learnability reward replaces the env's: on the last turn, the earlier turn's 0.5 used to stay
    assert proposal.reward == 0.96 and [t.reward for t in proposal.turns] == [0.0, 0.96]
    assert episode_reward_problems([TrajectoryGroup(env="e", task_id="t", trajectories=(proposal,))]) == []


def test_zero_reward_zeroes_every_role_trajectory_and_its_turns(monkeypatch, tokenizer):
    import tracegym.rollout.team as rollout_team
    from tracegym.algos import episode_reward_problems
    from tracegym.types import Trajectory, Turn

    async def failing_episode(factory, task, policies, **kwargs):  # a team episode whose env failed after rewards
        turn = Turn(prompt_ids=(1,), completion_ids=(2,), message=Message(role="assistant", content="x"), reward=0.5)
        return [Trajectory(env="e", task_id=task.id, sample_index=kwargs["sample_index"], messages=(), turns=(turn,),
                           reward=0.5, end_reason="env_error", error="boom", info={"role": role}) for role in ("alice", "bob")]

    monkeypatch.setattr(rollout_team, "play_team_episode", failing_episode)
    result = run_team_rollouts_sync(LetterTeam, LetterTeam().tasks("train", 1), "expert",
                                    get_renderer("smollm2-135m", tokenizer), RolloutConfig(on_env_error="zero_reward"))
    assert len(result.trajectories) == 2 and result.stats.failed == 1
    for t in result.trajectories:
        assert t.reward == 0.0 and [turn.reward for turn in t.turns] == [0.0]  # the turn used to keep its 0.5
    assert episode_reward_problems(group_by_role(result.trajectories)) == []


def test_docs_team_env_example_is_real():
    """The team env of docs/multi_lora.md is short, registers, and its expert team wins."""
    import re

    from tracegym.envs import make

    text = (Path(__file__).resolve().parents[1] / "docs" / "multi_lora.md").read_text(encoding="utf-8")
    section = text[text.index("A team env of your own"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert len(code.splitlines()) < 40
    namespace: dict[str, Any] = {"__name__": "docs_team_example"}
    exec(compile(code, "docs/multi_lora.md", "exec"), namespace)
    try:
        env = make("echo_team")
        task = env.tasks("test", 1)[0]
        trajectories = asyncio.run(play_team_episode(
            lambda: make("echo_team"), task,
            lambda e: {r: message_policy(lambda r=r: e.expert_action(r)) for r in e.roles}))
        assert [t.info["role"] for t in trajectories] == ["speaker", "listener"]
        assert all(t.success and t.reward == 1.0 for t in trajectories)
    finally:
        unregister("echo_team")


def test_counterfactual_credit_scores_each_role_turn(tokenizer):
    """C3 on a random team: every turn is scored; a turn after which nothing can change the outcome
    gets exactly R - mean(replacements), and a first message without its letter cannot be credited
    above 0 (its team can no longer win)."""
    from tracegym.engines.hf import HFEngine
    from tracegym.models import load
    from tracegym.rollout.team import score_team_counterfactual

    torch.manual_seed(0)
    model, _ = load("tiny-random")
    renderer = get_renderer("smollm2-135m", tokenizer)
    engine = HFEngine(model.eval(), tokenizer, stop_token_ids=renderer.stop_token_ids)
    tasks = LetterTeam().tasks("train", 4)
    config = RolloutConfig(max_turns=2, max_tokens_per_turn=3, samples_per_task=2, seed=3)
    result = run_team_rollouts_sync("test-letter-team", tasks, engine, renderer, config)
    scored, stats = asyncio.run(score_team_counterfactual("test-letter-team", result.trajectories, tasks, engine, renderer,
                                                          config, k=3, m=2))
    assert stats.decisions == 16 and stats.continuations == 16 * (2 + 2 * 2)
    by_episode: dict[str, dict[str, Any]] = {}
    for t in scored:
        assert len(t.turns) == 1 and "mc_advantage" in t.turns[0].metrics and "mc_continuation" in t.info
        by_episode.setdefault(t.info["episode_id"], {})[t.info["role"]] = t
    for team in by_episode.values():
        order = team["alice"].info["team_order"]
        first, second = team[order[0]], team[order[1]]
        letter = {"alice": "m", "bob": "e"}
        if letter[order[0]] not in first.turns[0].message.content:
            assert first.turns[0].metrics["mc_advantage"] <= 0.0
            assert second.turns[0].metrics["mc_advantage"] == 0.0  # nothing the second says can win
    groups = group_by_role(scored)
    from tracegym.algos import estimate

    adv = estimate("mc_continuation", groups).advantages
    assert [[a[0] for a in g] for g in adv] == [[t.turns[0].metrics["mc_advantage"] for t in g.trajectories] for g in groups]


def test_team_rl_with_counterfactual_credit_runs(tmp_path):
    train_any_rl(_config(tmp_path / "run", "steps=1", "advantage.intrinsic=mc_continuation",
                     "advantage.estimator=mc_continuation", "advantage.mc_k=2", "advantage.mc_m=1"))
    row = [r for r in read_metrics(tmp_path / "run") if r.get("step", 0) > 0][-1]
    assert row["c3_decisions"] == 24 and row["c3_continuations"] == 48 and "advantage/mc_advantage_abs_mean" in row


@pytest.mark.parametrize("example", ["rl_calc_relay.yaml", "rl_selfplay_calculator.yaml"])
def test_cli_runs_the_team_and_selfplay_examples(example, tmp_path, capsys):
    """The shipped configs run from the CLI (shrunk to the tiny random model and one step)."""
    from tracegym.cli import main

    examples = Path(__file__).resolve().parents[1] / "examples"
    overrides = ["model.name=tiny-random", "model.adapter=null", "lora.r=4", "tasks.train=4", "tasks.test=2",
                 "tasks_per_step=2", "group_size=2", "rollout.max_tokens_per_turn=4", "rollout.max_turns=3", "steps=1",
                 "eval.samples_per_task=1", "logging.progress=false", "logging.tensorboard=false",
                 f"output_dir={tmp_path / 'run'}"]
    assert main(["rl", "--config", str(examples / example), *overrides]) == 0
    assert "rl done: 1 steps" in capsys.readouterr().out
    final = tmp_path / "run" / "final"
    roles = ("planner", "solver") if "relay" in example else ("proposer", "solver")
    assert all((final / role / "adapter_config.json").is_file() for role in roles)
    rows = read_metrics(tmp_path / "run")
    assert "eval/pass@1" in rows[-1] and rows[0]["memory/adapter_mb/solver"] > 0


def test_eval_command_scores_team_episodes_once(tmp_path, capsys):
    """``tracegym eval`` on a team env: one outcome per episode (not per role), every role's
    trajectory kept."""
    import json

    from tracegym.cli import main

    out = tmp_path / "eval"
    assert main(["eval", "--env", "calc_relay", "--policy", "expert", "--tasks", "3", "--samples", "2", "--k", "1,2",
                 "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "eval.json").read_text())
    assert summary["n_trajectories"] == 6 and summary["samples_per_task"] == 2 and summary["success_rate"] == 1.0
    assert summary["pass_at"] == {"4": {"1": 1.0, "2": 1.0}}  # T: the whole episode (calc_relay: 4 turns)
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 12 and {json.loads(x)["info"]["role"] for x in lines} == {"planner", "solver"}


def test_weight_sync_sends_only_the_updated_adapters():
    from tracegym.engines.base import EngineCapabilities
    from tracegym.recipes.team import sync_adapters

    class Fake:
        def __init__(self, sync):
            self.capabilities, self.calls = EngineCapabilities(weight_sync=sync), []

        def update_weights(self, model, adapter=None):
            self.calls.append(adapter)

    copying, shared = Fake("adapter"), Fake("shared_model")
    sync_adapters(copying, object(), ["planner"])  # the solver is frozen: not re-sent
    sync_adapters(shared, object(), ["planner"])   # hf holds the model itself: one call, caches dropped
    assert copying.calls == ["planner"] and shared.calls == [None]
