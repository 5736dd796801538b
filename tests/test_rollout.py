"""Rollout runner: batching, limits and end reasons, fault injection, streaming to disk, expert path.

Most tests use a byte-level fake renderer and small fake envs/engines defined here, so each checks
one behaviour of the runner with hand-computable numbers; the last tests run the real calculator env
and renderer (and one slow test the real SmolLM2).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from tracegym.data.store import TrajectoryWriter, export_parquet, read_trajectories
from tracegym.envs.base import Env, Task
from tracegym.algos import episode_reward_problems
from tracegym.render.call_errors import failure_metrics
from tracegym.rollout import RolloutConfig, logprob_gap, run_rollouts, run_rollouts_sync, zero_reward
from tracegym.types import Generation, Message, ParsedCompletion, SamplingParams, StepResult, group_trajectories

EOT = 2  # end-of-turn id of the fake renderer


class ByteRenderer:
    """A minimal renderer: one token per character (ord % 200 + 10), turns closed by EOT."""

    name = "bytes"
    history_preserving = True

    def _enc(self, text: str) -> list[int]:
        return [ord(c) % 200 + 10 for c in text]

    def _msg(self, m: Message) -> list[int]:
        return [1] + self._enc(m.role + ":" + m.content) + [EOT]

    def render_prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        return [i for m in messages for i in self._msg(m)] + [1] + self._enc("assistant:")

    def continue_prompt(self, previous_prompt, completion_ids, new_messages) -> list[int]:
        ids = list(previous_prompt) + list(completion_ids)
        if not completion_ids or completion_ids[-1] != EOT:
            ids.append(EOT)
        return ids + [i for m in new_messages for i in self._msg(m)] + [1] + self._enc("assistant:")

    def encode_completion(self, message: Message) -> list[int]:
        return self._enc(message.content) + [EOT]

    def parse_completion(self, completion_ids) -> ParsedCompletion:
        ids = list(completion_ids)
        ended = bool(ids) and ids[-1] == EOT
        text = "".join(chr(i - 10) if 10 <= i < 210 else "?" for i in (ids[:-1] if ended else ids))
        errors = ("bad call",) if "!" in text else ()
        return ParsedCompletion(message=Message(role="assistant", content=text), errors=errors, ended_with_eot=ended)

    @property
    def stop_token_ids(self) -> list[int]:
        return [EOT]


class FakeEnv(Env):
    """Terminates after ``finish_at`` steps (None: never); can raise or hang at a given step."""

    name = "fake"

    def __init__(self, finish_at: int | None = 3, raise_at: int | None = None, hang_at: int | None = None,
                 release: asyncio.Event | None = None, truncate_at: int | None = None):
        self.finish_at, self.raise_at, self.hang_at = finish_at, raise_at, hang_at
        self.release, self.truncate_at = release, truncate_at
        self.steps = 0
        self.closed = False

    def tasks(self, split="train", n=100, seed=0):
        return [Task(id=f"t{i}", split=split, data={"i": i}) for i in range(n)]

    def tool_schemas(self):
        return [{"type": "function", "function": {"name": "noop", "description": "", "parameters": {"type": "object", "properties": {}}}}]

    async def reset(self, task):
        self.task = task
        return [Message(role="system", content="sys"), Message(role="user", content=f"task {task.id}")]

    async def step(self, message, parse_errors=()):
        self.steps += 1
        if self.raise_at == self.steps:
            raise RuntimeError("tool server died")
        if self.hang_at == self.steps:
            await asyncio.Event().wait()  # never set
        if self.release is not None and self.task.data.get("slow"):
            await self.release.wait()
        done = self.finish_at is not None and self.steps >= self.finish_at
        return StepResult(
            messages=() if done else (Message(role="user", content=f"obs{self.steps}"),),
            reward=0.25,
            terminated=done,
            truncated=self.truncate_at == self.steps,
            info={"success": done, "tool_calls": self.steps, "note": "text is dropped from metrics"},
        )

    def expert_action(self):
        return Message(role="assistant", content=f"expert step {self.steps}")

    def close(self):
        self.closed = True


class ScriptedEngine:
    """Returns ``completion`` for every prompt; records every call's batch size and params."""

    name = "scripted"
    returns_logprobs = True

    def __init__(self, completion: Sequence[int] = (82, 83, 84, EOT), fail: bool = False):
        self.completion = tuple(completion)
        self.calls: list[int] = []
        self.params: list[SamplingParams] = []
        self.fail = fail

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        self.params.append(params)
        if self.fail:
            raise RuntimeError("CUDA out of memory (simulated)")
        toks = self.completion[: params.max_tokens]
        finish = "stop" if toks and toks[-1] == EOT else "length"
        return [[Generation(token_ids=toks, logprobs=tuple(-0.5 for _ in toks), finish_reason=finish)] for _ in prompts]


def tasks(n: int, **data: Any) -> list[Task]:
    return [Task(id=f"t{i}", data=dict(data)) for i in range(n)]


def run(env_factory, task_list, policy, config, **kw):
    return run_rollouts_sync(env_factory, task_list, policy, ByteRenderer(), config, progress=False, **kw)


# --- batching and token-in/token-out ---------------------------------------------------------------


def test_all_waiting_episodes_share_one_generate_call():
    engine = ScriptedEngine()
    cfg = RolloutConfig(max_turns=5, samples_per_task=2, temperature=0.7, seed=3)
    res = run(lambda: FakeEnv(finish_at=3), tasks(3), engine, cfg)
    # 6 episodes x 3 turns in lock-step: exactly 3 engine calls of 6 prompts
    assert engine.calls == [6, 6, 6]
    assert res.stats.generate_calls == 3 and res.stats.mean_batch_size == 6
    assert [p.stop_token_ids for p in engine.params] == [(EOT,)] * 3
    assert engine.params[0].temperature == 0.7
    # each call gets its own seed derived from config.seed, and the same on a rerun
    seeds = [p.seed for p in engine.params]
    assert len(set(seeds)) == 3
    engine2 = ScriptedEngine()
    run(lambda: FakeEnv(finish_at=3), tasks(3), engine2, cfg)
    assert [p.seed for p in engine2.params] == seeds

    assert len(res.trajectories) == 6
    assert [(t.task_id, t.sample_index) for t in res.trajectories] == [
        ("t0", 0), ("t0", 1), ("t1", 0), ("t1", 1), ("t2", 0), ("t2", 1)]
    t = res.trajectories[0]
    assert t.end_reason == "terminated" and t.success and t.reward == pytest.approx(0.75)
    assert t.metrics == {"success": 1.0, "tool_calls": 3.0, **failure_metrics({})}  # no failed call
    assert len(t.turns) == 3 and len(t.tools) == 1 and t.env == "fake"
    # token-in, token-out: each prompt extends the previous prompt + its sampled ids
    r = ByteRenderer()
    assert list(t.turns[0].prompt_ids) == r.render_prompt(t.messages[:2])
    for a, b in zip(t.turns, t.turns[1:]):
        assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == a.prompt_ids + a.completion_ids
    assert t.turns[0].completion_logprobs == (-0.5,) * 4
    assert t.turns[0].message.content == "HIJ"  # ids 82,83,84 decoded by the fake renderer
    # messages: system, user, then (assistant, observation) per turn, no observation after the last
    assert [m.role for m in t.messages] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert res.stats.generated_tokens == 6 * 3 * 4
    assert res.stats.end_reasons == {"terminated": 6}


def test_concurrency_limit_bounds_the_batch():
    engine = ScriptedEngine()
    res = run(lambda: FakeEnv(finish_at=2), tasks(5), engine, RolloutConfig(concurrency=2))
    assert max(engine.calls) <= 2 and sum(engine.calls) == 10
    assert len(res.trajectories) == 5


# --- limits and end reasons --------------------------------------------------------------------


def test_max_turns():
    res = run(lambda: FakeEnv(finish_at=None), tasks(2), ScriptedEngine(), RolloutConfig(max_turns=4))
    assert {t.end_reason for t in res.trajectories} == {"max_turns"}
    assert all(len(t.turns) == 4 for t in res.trajectories)
    assert all(not t.success for t in res.trajectories)


def test_env_truncation_is_not_termination():
    res = run(lambda: FakeEnv(finish_at=None, truncate_at=2), tasks(1), ScriptedEngine(), RolloutConfig(max_turns=5))
    assert res.trajectories[0].end_reason == "truncated" and len(res.trajectories[0].turns) == 2


def test_episode_token_budget_cuts_the_last_turn():
    engine = ScriptedEngine(completion=(82, 83, 84, 85, EOT))  # 5 tokens per turn
    cfg = RolloutConfig(max_turns=10, max_tokens_per_episode=12)
    res = run(lambda: FakeEnv(finish_at=None), tasks(1), engine, cfg)
    t = res.trajectories[0]
    assert t.end_reason == "max_tokens"
    assert [len(x.completion_ids) for x in t.turns] == [5, 5, 2]
    assert [x.finish_reason for x in t.turns] == ["stop", "stop", "length"]
    assert engine.params[-1].max_tokens == 2
    assert t.num_generated_tokens == 12


def test_per_turn_token_limit():
    engine = ScriptedEngine(completion=(82, 83, 84, 85, EOT))
    res = run(lambda: FakeEnv(finish_at=1), tasks(1), engine, RolloutConfig(max_tokens_per_turn=3))
    turn = res.trajectories[0].turns[0]
    assert turn.completion_ids == (82, 83, 84) and turn.finish_reason == "length"
    assert turn.message.content == "HIJ"


def test_context_limit():
    r = ByteRenderer()
    first = len(r.render_prompt([Message(role="system", content="sys"), Message(role="user", content="task t0")]))
    # turn 1 fits (4 tokens of room); the second prompt adds the completion and an observation
    cfg = RolloutConfig(max_turns=5, max_context=first + 10)
    res = run(lambda: FakeEnv(finish_at=None), tasks(1), ScriptedEngine(), cfg)
    t = res.trajectories[0]
    assert t.end_reason == "context" and len(t.turns) == 1
    # a context so small that even the completion is cut
    res = run(lambda: FakeEnv(finish_at=None), tasks(1), ScriptedEngine(), RolloutConfig(max_context=first + 2))
    t = res.trajectories[0]
    assert t.end_reason == "context" and t.turns[0].completion_ids == (82, 83)
    res = run(lambda: FakeEnv(finish_at=None), tasks(1), ScriptedEngine(), RolloutConfig(max_context=first))
    assert res.trajectories[0].end_reason == "context" and res.trajectories[0].turns == ()


def test_parse_errors_reach_the_env_and_the_turn():
    engine = ScriptedEngine(completion=(ord("!") + 10, EOT))
    seen: list[tuple[str, ...]] = []

    class Recording(FakeEnv):
        async def step(self, message, parse_errors=()):
            seen.append(tuple(parse_errors))
            return await super().step(message, parse_errors)

    res = run(lambda: Recording(finish_at=1), tasks(1), engine, RolloutConfig())
    assert seen == [("bad call",)] and res.trajectories[0].turns[0].parse_errors == ("bad call",)


# --- fault injection -------------------------------------------------------------------------------


def test_env_that_raises_at_step_2_is_isolated(tmp_path: Path):
    envs: list[FakeEnv] = []

    def factory():
        env = FakeEnv(finish_at=3, raise_at=2 if len(envs) == 1 else None)
        envs.append(env)
        return env

    with TrajectoryWriter(tmp_path / "ok.jsonl") as ok, TrajectoryWriter(tmp_path / "bad.jsonl") as bad:
        res = run(factory, tasks(3), ScriptedEngine(), RolloutConfig(), writer=ok, failed_writer=bad)
    assert res.stats.episodes == 3 and res.stats.kept == 2 and res.stats.failed == 1
    assert res.stats.end_reasons == {"terminated": 2, "env_error": 1}
    [f] = res.failed
    assert f.task_id == "t1" and f.end_reason == "env_error" and "tool server died" in f.error
    assert len(f.turns) == 1  # the turn before the failing step is kept for inspection
    assert "tool server died" in res.stats.errors[0]
    assert all(e.closed for e in envs)
    assert sorted(t.task_id for t in read_trajectories(tmp_path / "ok.jsonl")) == ["t0", "t2"]
    assert [t.task_id for t in read_trajectories(tmp_path / "bad.jsonl")] == ["t1"]


def test_zero_reward_mode_keeps_failed_episodes():
    calls = {"n": 0}

    def factory():
        calls["n"] += 1
        return FakeEnv(finish_at=3, raise_at=2 if calls["n"] == 1 else None)

    res = run(factory, tasks(2), ScriptedEngine(), RolloutConfig(on_env_error="zero_reward"))
    assert len(res.trajectories) == 2 and res.failed == []
    bad = res.trajectories[0]
    assert bad.end_reason == "env_error" and bad.reward == 0.0 and not bad.success
    # the turn before the failing step earned 0.25: zeroed too, so the episode reward stays the sum of the turn
    # rewards (it used to keep 0.25 there, and episode and per-turn estimators disagreed on the episode)
    assert len(bad.turns) == 1 and [t.reward for t in bad.turns] == [0.0]
    assert episode_reward_problems(group_trajectories(res.trajectories)) == []
    assert res.stats.mean_reward == pytest.approx(0.75 / 2)


def test_zero_reward_zeroes_the_episode_and_every_turn():
    from tracegym.types import Trajectory, Turn

    turns = tuple(Turn(prompt_ids=(1,), completion_ids=(2,), message=Message(role="assistant"), reward=r) for r in (0.5, 0.25))
    failed = Trajectory(env="e", task_id="t", messages=(), turns=turns, reward=0.75, end_reason="env_error", error="boom")
    zeroed = zero_reward(failed)
    assert zeroed.reward == 0.0 and [t.reward for t in zeroed.turns] == [0.0, 0.0]
    assert zeroed.end_reason == "env_error" and zeroed.error == "boom" and zeroed.turns[0].completion_ids == (2,)


def test_env_that_hangs_times_out_without_stalling_the_others():
    calls = {"n": 0}

    def factory():
        calls["n"] += 1
        return FakeEnv(finish_at=3, hang_at=2 if calls["n"] == 2 else None)

    engine = ScriptedEngine()
    res = run(factory, tasks(3), engine, RolloutConfig(episode_timeout_s=1.0, batch_wait_s=0.01))
    assert res.stats.end_reasons == {"terminated": 2, "timeout": 1}
    assert res.failed[0].task_id == "t1" and res.failed[0].error == "episode timed out after 1 s"
    assert len(res.failed[0].turns) == 1  # the turn before the hang is kept
    # the healthy episodes did not wait for the hanging one (turn 3 ran without it)
    assert engine.calls == [3, 3, 2]
    assert res.stats.wall_time_s < 5


def test_reset_and_factory_failures_are_env_errors():
    class BadReset(FakeEnv):
        async def reset(self, task):
            raise ValueError("no such task")

    def bad_factory():
        raise ImportError("missing optional dependency")

    res = run(lambda: BadReset(), tasks(1), ScriptedEngine(), RolloutConfig())
    assert res.failed[0].end_reason == "env_error" and "no such task" in res.failed[0].error
    res = run(bad_factory, tasks(1), ScriptedEngine(), RolloutConfig())
    assert res.failed[0].end_reason == "env_error" and "missing optional dependency" in res.failed[0].error


def test_engine_failure_is_recorded_not_raised():
    res = run(lambda: FakeEnv(), tasks(2), ScriptedEngine(fail=True), RolloutConfig())
    assert res.stats.end_reasons == {"engine_error": 2}
    assert "out of memory" in res.failed[0].error


@pytest.mark.parametrize("on_env_error", ["exclude", "zero_reward"])
def test_non_finite_reward_is_a_failed_env_error(on_env_error: str, tmp_path: Path):
    class NaNAt2(FakeEnv):
        async def step(self, message, parse_errors=()):
            result = await super().step(message, parse_errors)
            if self.task.id == "t1" and self.steps == 2:
                return result.model_copy(update={"reward": float("nan")})
            return result

    with TrajectoryWriter(tmp_path / "ok.jsonl") as ok, TrajectoryWriter(tmp_path / "bad.jsonl") as bad:
        res = run(lambda: NaNAt2(finish_at=3), tasks(3), ScriptedEngine(), RolloutConfig(on_env_error=on_env_error),
                  writer=ok, failed_writer=bad)
    assert res.stats.end_reasons == {"terminated": 2, "env_error": 1} and res.stats.failed == 1
    [failed] = [t for t in res.trajectories + res.failed if t.end_reason == "env_error"]
    assert failed.task_id == "t1" and "t1" in failed.error and "nan" in failed.error
    # the NaN step is not recorded; zero_reward zeroes the turn that was, with the episode reward
    assert [turn.reward for turn in failed.turns] == ([0.0] if on_env_error == "zero_reward" else [0.25])
    assert failed.reward == (0.0 if on_env_error == "zero_reward" else 0.25) and not failed.success
    assert "non-finite reward nan" in res.stats.errors[0]
    for path in (tmp_path / "ok.jsonl", tmp_path / "bad.jsonl"):
        for row in map(json.loads, path.read_text().splitlines()):
            assert row["reward"] is not None and all(t["reward"] is not None for t in row["turns"])
    assert res.stats.mean_reward == pytest.approx(sum(t.reward for t in res.trajectories) / len(res.trajectories))


def test_expert_failure_is_an_engine_error():
    class BrokenExpert(FakeEnv):
        def expert_action(self):
            raise KeyError("no plan")

    res = run(lambda: BrokenExpert(), tasks(1), "expert", RolloutConfig())
    assert res.failed[0].end_reason == "engine_error"
    assert res.failed[0].error == "expert_action failed: KeyError: 'no plan'"


# --- streaming to disk ---------------------------------------------------------------------------


def test_trajectories_are_on_disk_as_soon_as_they_finish(tmp_path: Path):
    path = tmp_path / "traj.jsonl"

    async def main():
        release = asyncio.Event()
        task_list = [Task(id="fast", data={}), Task(id="slow", data={"slow": True})]
        with TrajectoryWriter(path) as writer:
            job = asyncio.create_task(run_rollouts(
                lambda: FakeEnv(finish_at=1, release=release), task_list, ScriptedEngine(), ByteRenderer(),
                RolloutConfig(), writer=writer, progress=False))
            for _ in range(200):
                await asyncio.sleep(0.01)
                if path.exists() and path.read_text().count("\n") == 1:
                    break
            lines = path.read_text().splitlines()
            assert len(lines) == 1 and json.loads(lines[0])["task_id"] == "fast"
            assert not job.done()  # the slow episode is still in flight
            release.set()
            return await job

    res = asyncio.run(main())
    assert [t.task_id for t in read_trajectories(path)] == ["fast", "slow"]
    assert len(res.trajectories) == 2
    assert export_parquet(path, tmp_path / "traj.parquet") == 2
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "traj.parquet")
    assert table.column("task_id").to_pylist() == ["fast", "slow"]
    assert table.column("num_turns").to_pylist() == [1, 1]


def test_reader_skips_a_torn_last_line(tmp_path: Path):
    res = run(lambda: FakeEnv(finish_at=1), tasks(2), ScriptedEngine(), RolloutConfig())
    path = tmp_path / "t.jsonl"
    with TrajectoryWriter(path) as w:
        w.write_all(res.trajectories)
    with open(path, "a") as f:
        f.write(res.trajectories[0].model_dump_json()[:50])  # crash mid-write
    assert [t.task_id for t in read_trajectories(path)] == ["t0", "t1"]


# --- expert and message-level paths ------------------------------------------------------------------


def test_expert_policy_goes_through_the_token_path():
    task_list = [Task(id="a", data={"reference_calls": [{"name": "noop", "arguments": {}}]})]
    res = run(lambda: FakeEnv(finish_at=2), task_list, "expert", RolloutConfig())
    t = res.trajectories[0]
    r = ByteRenderer()
    assert t.policy == "expert" and t.end_reason == "terminated"
    assert [x.message.content for x in t.turns] == ["expert step 0", "expert step 1"]
    assert all(x.completion_ids == tuple(r.encode_completion(x.message)) for x in t.turns)
    assert all(x.completion_logprobs is None for x in t.turns)
    assert t.info["reference_calls"] == [{"name": "noop", "arguments": {}}]
    assert res.stats.generate_calls == 0


def test_message_level_engine_path():
    class ChatEngine:
        name = "chat"
        returns_logprobs = False

        def __init__(self):
            self.seen: list[tuple[int, int | None, int]] = []

        def chat(self, messages, tools, params):
            self.seen.append((len(messages), len(tools) if tools else None, params.max_tokens))
            return Message(role="assistant", content=f"reply {len(messages)}")

    engine = ChatEngine()
    res = run(lambda: FakeEnv(finish_at=2), tasks(1), engine, RolloutConfig(max_tokens_per_turn=7))
    t = res.trajectories[0]
    assert engine.seen == [(2, 1, 7), (4, 1, 7)]
    assert t.turns[1].completion_ids == tuple(ByteRenderer().encode_completion(Message(role="assistant", content="reply 4")))
    assert t.turns[1].completion_logprobs is None and t.policy == "chat"


def test_engine_abilities_come_from_capabilities():
    from tracegym.engines.base import EngineCapabilities

    class Both(ScriptedEngine):
        """Has both generate and chat; which one the runner uses depends on its abilities."""

        returns_logprobs = False  # the old attribute; capabilities wins when present

        def __init__(self, caps):
            super().__init__()
            self.caps, self.chats = caps, 0

        @property
        def capabilities(self):
            return self.caps

        def chat(self, messages, tools, params):
            self.chats += 1
            return Message(role="assistant", content="chat")

    token = Both(EngineCapabilities(returns_logprobs=True))
    res = run(lambda: FakeEnv(finish_at=1), tasks(1), token, RolloutConfig())
    assert token.calls == [1] and token.chats == 0 and res.trajectories[0].turns[0].completion_logprobs is not None
    text = Both(EngineCapabilities(returns_logprobs=False, exact_token_ids=False))
    res = run(lambda: FakeEnv(finish_at=1), tasks(1), text, RolloutConfig())
    assert text.calls == [] and text.chats == 1 and res.trajectories[0].turns[0].completion_logprobs is None
    # without capabilities, the old attribute decides
    old = Both(None)
    run(lambda: FakeEnv(finish_at=1), tasks(1), old, RolloutConfig())
    assert old.calls == [] and old.chats == 1


def test_runner_turns_carry_state_keys():
    res = run(lambda: FakeEnv(finish_at=3), tasks(2), ScriptedEngine(), RolloutConfig(samples_per_task=2))
    keys = [[turn.state_key for turn in t.turns] for t in res.trajectories]
    assert all(len(k) == 3 and all(isinstance(x, str) and len(x) == 16 for x in k) for k in keys)
    assert keys[0] == keys[1] and keys[2] == keys[3]  # same task, same observations
    assert keys[0][0] != keys[2][0]  # the task's prompt differs
    assert len(set(keys[0])) == 3  # each observation moves the state


def test_bad_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy"):
        run(lambda: FakeEnv(), tasks(1), "random", RolloutConfig())
    with pytest.raises(Exception, match="on_env_error"):
        RolloutConfig(on_env_error="ignore")


# --- real engine: sampled log-probs vs teacher forcing ---------------------------------------------


def _tiny_llama(vocab: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def test_hf_engine_rollout_logprob_gap_is_near_zero_and_seeded():
    from tracegym.engines.hf import HFEngine

    engine = HFEngine(_tiny_llama(), max_batch_size=4)
    cfg = RolloutConfig(max_turns=3, max_tokens_per_turn=6, samples_per_task=2, temperature=0.9, top_p=0.95,
                        seed=11, measure_logprob_gap=True)
    res = run(lambda: FakeEnv(finish_at=3), tasks(3), engine, cfg)
    gap = res.stats.logprob_gap
    assert gap is not None and gap.tokens == res.stats.generated_tokens > 0
    assert gap.max < 1e-4
    again = run(lambda: FakeEnv(finish_at=3), tasks(3), engine, cfg)
    assert [t.turns for t in again.trajectories] == [t.turns for t in res.trajectories]
    # a different seed samples something else
    other = run(lambda: FakeEnv(finish_at=3), tasks(3), engine, cfg.model_copy(update={"seed": 12}))
    assert [t.turns for t in other.trajectories] != [t.turns for t in res.trajectories]
    # the gap function itself detects a mismatch: score at another temperature
    assert logprob_gap(engine.model, res.trajectories, temperature=0.5, top_p=0.95).mean > 1e-3
    # a bounded check re-scores evenly spaced turns, the first and the last among them
    turns = [t for traj in res.trajectories for t in traj.turns]
    assert len(turns) > 2
    sampled = logprob_gap(engine.model, res.trajectories, temperature=0.9, top_p=0.95, max_turns=2)
    assert sampled.tokens == len(turns[0].completion_ids) + len(turns[-1].completion_ids) and sampled.max < 1e-4


# --- the real calculator env and renderer ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_renderer():
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer

    return get_renderer("smollm2-135m", load_tokenizer("smollm2-135m"))


def test_expert_on_calculator_is_valid_sft_data(smollm2_renderer, tmp_path: Path):
    from tracegym.envs import make

    renderer = smollm2_renderer
    task_list = make("calculator", num_calls=2).tasks("train", n=3, seed=1)
    with TrajectoryWriter(tmp_path / "e.jsonl") as w:
        res = run_rollouts_sync("calculator", task_list, "expert", renderer, RolloutConfig(max_turns=6),
                                writer=w, progress=False, env_options={"num_calls": 2})
    assert res.stats.success_rate == 1.0 and res.stats.end_reasons == {"terminated": 3}
    by_id = {task.id: task for task in task_list}
    for t in res.trajectories:
        assert len(t.turns) == 3  # two calls, then the answer
        assert t.metrics["success"] == 1.0 and t.reward == 1.0
        assert t.info["reference_calls"] == by_id[t.task_id].data["reference_calls"]
        assert len(t.info["reference_calls"]) == 2
        for turn in t.turns:
            assert turn.completion_ids == tuple(renderer.encode_completion(turn.message))
            assert turn.completion_logprobs is None
            # the recorded ids parse back to the expert's calls
            parsed = renderer.parse_completion(turn.completion_ids).message
            assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
                (c.name, c.arguments) for c in turn.message.tool_calls]
        # one training example covering the whole episode; loss only on the expert's tokens
        [example] = renderer.build_examples(t)
        assert sum(example.loss_mask) == t.num_generated_tokens
    assert len(list(read_trajectories(tmp_path / "e.jsonl"))) == 3


def test_cli_rollout_writes_trajectories_and_summary(tmp_path: Path):
    from tracegym.cli import main

    out = tmp_path / "run"
    rc = main(["rollout", "--env", "calculator", "--model", "tiny-random", "--tasks", "2", "--samples", "2",
               "--max-turns", "2", "--max-tokens-per-turn", "8", "--temperature", "1.0", "--seed", "3",
               "--no-progress", "--parquet", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 4 and summary["kept"] + summary["failed"] == 4
    assert sum(summary["end_reasons"].values()) == 4
    assert summary["logprob_gap"]["max"] < 1e-4 and summary["logprob_gap"]["tokens"] == summary["generated_tokens"]
    trajs = list(read_trajectories(out / "trajectories.jsonl"))
    assert len(trajs) == summary["kept"] and all(t.policy == "tiny-random" for t in trajs)
    assert (out / "trajectories.parquet").exists()
    assert main(["rollout", "--env", "no-such-env", "--out", str(tmp_path / "x")]) == 2


@pytest.mark.slow
def test_smollm2_multi_turn_rollout_on_calculator(smollm2_renderer, tmp_path: Path):
    from tracegym.engines.hf import HFEngine
    from tracegym.envs import make
    from tracegym.models import load

    model, tokenizer = load("smollm2-135m")
    renderer = smollm2_renderer
    engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    task_list = make("calculator", num_calls=2).tasks("train", n=2, seed=0)
    cfg = RolloutConfig(max_turns=3, max_tokens_per_turn=48, samples_per_task=2, temperature=1.0, seed=0,
                        measure_logprob_gap=True)
    with TrajectoryWriter(tmp_path / "t.jsonl") as w:
        res = run_rollouts_sync("calculator", task_list, engine, renderer, cfg, writer=w, progress=False,
                                env_options={"num_calls": 2})
    on_disk = list(read_trajectories(tmp_path / "t.jsonl"))
    assert len(on_disk) == len(res.trajectories) == 4 and res.stats.failed == 0
    assert res.stats.logprob_gap.max < 1e-3
    for t in res.trajectories:
        assert 1 <= len(t.turns) <= 3
        assert set(t.end_reason for t in res.trajectories) <= {"terminated", "truncated", "max_turns"}
        for a, b in zip(t.turns, t.turns[1:]):
            assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == a.prompt_ids + a.completion_ids
        for turn in t.turns:
            assert len(turn.completion_ids) == len(turn.completion_logprobs) <= 48
            assert turn.finish_reason == ("stop" if turn.completion_ids[-1] in renderer.stop_token_ids else "length")
