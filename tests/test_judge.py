"""LLM-judge rewards (``tracegym.rl.judge``, ``reward.judge``): what the judge reads, how its replies
parse, how its score joins the reward (the episode reward stays the sum of turn rewards), RULER-style
ranking with a measured position bias, failures counted and never a silent 0, the cache, and one RL
step judged by the project's own server on loopback."""

from __future__ import annotations

import json
import math
import os
import re

import httpx
import pytest

from tracegym.config.rl import JudgeConfig
from tracegym.rl.judge import Judge, JudgeError, judge_groups, parse_ranking, parse_score, spearman, transcript
from tracegym.types import Message, ToolCall, Trajectory, TrajectoryGroup, Turn


def _turn(reward: float) -> Turn:
    return Turn(prompt_ids=(1, 2), completion_ids=(3,), message=Message(role="assistant", content="x"), reward=reward)


def _episode(task: str, i: int, answer: str, rewards: tuple[float, ...]) -> Trajectory:
    messages = (
        Message(role="system", content="You are a calculator agent. SYSTEM-ONLY"),
        Message(role="user", content=f"Task {task}: what is 2 + 40?"),
        Message(role="assistant", tool_calls=(ToolCall(name="calculate", arguments={"expression": "2 + 40"}, id="c0"),)),
        Message(role="tool", content="42", tool_call_id="c0", name="calculate"),
        Message(role="assistant", content=f"Done ({i}): <answer>{answer}</answer>"),
    )
    return Trajectory(env="calculator", task_id=task, sample_index=i, messages=messages,
                      turns=tuple(_turn(r) for r in rewards), reward=sum(rewards), success=answer == "42")


def _groups() -> list[TrajectoryGroup]:
    return [TrajectoryGroup(env="calculator", task_id=task, trajectories=(
        _episode(task, 0, "42", (0.25, 0.75)), _episode(task, 1, "41", (0.0, 0.0)), _episode(task, 2, "42", (0.5, 0.5))))
        for task in ("t0", "t1")]


class FakeJudge:
    """An OpenAI-compatible judge over httpx.MockTransport: ``answer(prompt) -> reply text``."""

    def __init__(self, answer):
        self.answer, self.prompts = answer, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt = body["messages"][-1]["content"]
        self.prompts.append(prompt)
        reply = self.answer(prompt)
        if isinstance(reply, httpx.Response):
            return reply
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": reply}}],
                                         "usage": {"prompt_tokens": 100, "completion_tokens": 10}})


def _judge(answer, tmp_path=None, **options) -> tuple[Judge, FakeJudge]:
    fake = FakeJudge(answer)
    cfg = JudgeConfig(base_url="http://judge.test/v1", model="judge", max_retries=0, **options)
    return Judge(cfg, tmp_path / "cache.jsonl" if tmp_path else None, transport=httpx.MockTransport(fake)), fake


def _attempts(prompt: str) -> list[str]:
    """The answers of a ranking prompt's attempts, in the order shown."""
    return re.findall(r"<answer>(\d+)</answer>", prompt)


def test_the_judge_reads_the_episode_without_its_system_prompt():
    text = transcript(_episode("t0", 0, "42", (1.0,)))
    assert "SYSTEM-ONLY" not in text
    assert text.splitlines()[0] == "[user]" and '[assistant]\ncall calculate({"expression": "2 + 40"})' in text
    assert "[tool calculate]\n42" in text and text.endswith("Done (0): <answer>42</answer>")
    cut = transcript(_episode("t0", 0, "42" * 400, (1.0,)), max_chars=300)
    assert len(cut) <= 300 and "characters cut" in cut and cut.startswith("[user]")


@pytest.mark.parametrize(("reply", "score"), [
    ('{"reason": "right", "score": 0.8}', 0.8),
    ('```json\n{"score": 1}\n```', 1.0),
    ('The episode is fine. {"reason": "ok", "score": "0.5"} Done.', 0.5),
    ("score: 0.25", 0.25),
    ('{"score": 7}', None),          # outside [0, 1]: not silently clipped
    ('{"score": NaN}', None),
    ('{"score": true}', None),
    ("I think it is good.", None),
])
def test_rubric_replies_parse_or_fail(reply, score):
    assert parse_score(reply) == score


def test_ranking_replies_parse_or_fail():
    assert parse_ranking('{"scores": [{"id": 2, "score": 0.1}, {"id": 1, "score": 0.9}]}', 2) == [0.9, 0.1]
    assert parse_ranking('{"scores": [{"id": "1", "score": 1}, {"id": "2", "score": 0}]}', 2) == [1.0, 0.0]
    assert parse_ranking("[0.5, 1.0, 0.0]", 3) == [0.5, 1.0, 0.0]
    assert parse_ranking('{"scores": [{"id": 1, "score": 0.9}]}', 2) is None                       # one missing
    assert parse_ranking('{"scores": [{"id": 1, "score": 0.9}, {"id": 1, "score": 0.1}]}', 2) is None  # id twice
    assert parse_ranking('{"scores": [{"id": 1, "score": 0.9}, {"id": 3, "score": 0.1}]}', 2) is None  # no id 2
    assert parse_ranking('{"scores": [{"id": 1, "score": 1.5}, {"id": 2, "score": 0.1}]}', 2) is None
    assert parse_ranking("no idea", 2) is None


def test_rubric_scores_join_the_reward_by_weight_and_turn_rewards_still_sum(tmp_path):
    judge, fake = _judge(lambda p: '{"reason": "r", "score": %s}' % ("1.0" if "<answer>42</answer>" in p else "0.0"),
                         tmp_path, weight=2.0, verifiable_weight=0.5)
    groups, tasks, stats = judge_groups(judge, _groups(), ["task0", "task1"], seed=0)
    assert tasks == ["task0", "task1"] and len(fake.prompts) == 6
    for group in groups:
        (right, wrong, right2) = group.trajectories
        assert right.reward == pytest.approx(0.5 * 1.0 + 2.0) and wrong.reward == 0.0 and right2.reward == pytest.approx(2.5)
        assert [t.reward for t in right.turns] == pytest.approx([0.125, 0.375 + 2.0])
        for t in group.trajectories:
            assert math.isclose(sum(turn.reward for turn in t.turns), t.reward)
            assert t.metrics["reward/judge"] in (0.0, 1.0) and t.info["judge"]["mode"] == "rubric"
            assert t.info["judge"]["raw"][0].startswith('{"reason": "r"')
    metrics = stats.metrics()
    assert metrics == {"judge/calls": 6.0, "judge/cache_hits": 0.0, "judge/tokens": 660.0, "judge/seconds": metrics["judge/seconds"],
                       "judge/parse_failures": 0.0, "judge/errors": 0.0, "judge/dropped_groups": 0.0,
                       "judge/score_mean": pytest.approx(4 / 6)}
    # the same episodes again: every reply from the cache, nothing paid
    _, _, again = judge_groups(judge, _groups(), ["task0", "task1"], seed=0)
    assert (again.calls, again.cache_hits, again.tokens, len(fake.prompts)) == (0, 6, 0, 6)
    judge.close()
    # a new judge on the same cache file (a resumed run) pays nothing either; a torn last line is skipped
    with (tmp_path / "cache.jsonl").open("a") as handle:
        handle.write('{"key": "abc", "content": "tor')
    resumed, fake2 = _judge(lambda p: '{"score": 0.0}', tmp_path, weight=2.0, verifiable_weight=0.5)
    groups2, _, stats2 = judge_groups(resumed, _groups(), ["task0", "task1"], seed=0)
    assert fake2.prompts == [] and stats2.cache_hits == 6 and [t.reward for t in groups2[0].trajectories] == [2.5, 0.0, 2.5]
    # a new reply after the torn line lands on a line of its own and is read back by the next judge
    judge_groups(resumed, [_groups()[0].model_copy(update={"task_id": "t9"})], ["task9"], seed=0)
    assert len(fake2.prompts) == 0  # same transcripts: cached; a new transcript is asked and kept
    other = TrajectoryGroup(env="calculator", task_id="t7", trajectories=(_episode("t7", 0, "42", (1.0,)),))
    judge_groups(resumed, [other], ["task7"], seed=0)
    assert len(fake2.prompts) == 1
    third, fake3 = _judge(lambda p: '{"score": 0.0}', tmp_path)
    judge_groups(third, [other], ["task7"], seed=0)
    assert fake3.prompts == []


def test_ranking_sees_the_group_together_and_measures_position_bias():
    # a fair judge: 1 for a right answer wherever it stands
    fair, fake = _judge(lambda p: json.dumps({"scores": [{"id": i + 1, "score": float(a == "42")}
                                                         for i, a in enumerate(_attempts(p))]}), mode="ranking")
    groups, _, stats = judge_groups(fair, _groups(), ["a", "b"], seed=3)
    assert len(fake.prompts) == 4 and all(len(_attempts(p)) == 3 for p in fake.prompts)
    assert [_attempts(p) for p in fake.prompts[:1]] == [["42", "41", "42"]]
    assert [t.metrics["reward/judge"] for t in groups[0].trajectories] == [1.0, 0.0, 1.0]
    assert stats.metrics()["judge/position_bias"] == 0.0 and len(groups[0].trajectories[0].info["judge"]["raw"]) == 2
    # a judge that only likes the first position: the shuffled order exposes it, and averages it out
    biased, _ = _judge(lambda p: json.dumps({"scores": [1.0] + [0.0] * (len(_attempts(p)) - 1)}), mode="ranking")
    groups, _, stats = judge_groups(biased, _groups(), ["a", "b"], seed=3)
    assert stats.metrics()["judge/position_bias"] == pytest.approx(2 / 3)  # per group: 2 of 3 episodes moved 1.0
    assert all(sum(t.metrics["reward/judge"] for t in g.trajectories) == pytest.approx(1.0) for g in groups)
    # without the check: one call per group, no bias figure
    once, fake3 = _judge(lambda p: "[1, 0, 0]", mode="ranking", position_bias=False)
    _, _, stats = judge_groups(once, _groups(), ["a", "b"], seed=3)
    assert len(fake3.prompts) == 2 and "judge/position_bias" not in stats.metrics()


def test_a_garbage_reply_drops_its_group_and_is_counted():
    judge, _ = _judge(lambda p: "I refuse." if "Task t1" in p and "<answer>41</answer>" in p else '{"score": 0.5}')
    groups, tasks, stats = judge_groups(judge, _groups(), ["task0", "task1"], seed=0)
    assert [g.task_id for g in groups] == ["t0"] and tasks == ["task0"]
    assert (stats.parse_failures, stats.failed_groups, stats.errors) == (1, 1, 0)
    judged, _ = judge.score_groups(_groups())  # the failed group's raw replies are kept, not just counted
    assert judged[0].scores == [0.5] * 3 and judged[1].scores is None and judged[1].raw[1] == "I refuse."
    stopping, _ = _judge(lambda p: "I refuse.", on_failure="stop")
    with pytest.raises(JudgeError, match="group of task 't0'.*on_failure: stop"):
        judge_groups(stopping, _groups(), ["task0", "task1"], seed=0)


def test_an_unreachable_or_failing_judge_is_counted_not_scored_zero():
    def down(prompt):
        raise httpx.ConnectError("connection refused")

    judge, _ = _judge(down)
    groups, tasks, stats = judge_groups(judge, _groups(), ["task0", "task1"], seed=0)
    assert groups == [] and tasks == [] and (stats.errors, stats.failed_groups, stats.parse_failures) == (6, 2, 0)
    judge, _ = _judge(lambda p: httpx.Response(401, json={"error": {"message": "bad key"}}))
    _, _, stats = judge_groups(judge, _groups(), ["task0", "task1"], seed=0)
    assert stats.errors == 6 and stats.metrics()["judge/dropped_groups"] == 2.0


def test_spearman_against_hand_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties: ranks x = [1, 2.5, 2.5, 4], y = [1, 2, 3, 4]: r = 4.5 / sqrt(4.5 * 5)
    assert spearman([0, 1, 1, 2], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_a_judge_config_is_checked_and_single_agent():
    from tracegym.config import RLConfig

    with pytest.raises(ValueError, match="mode"):
        RLConfig(reward={"judge": {"base_url": "http://x/v1", "model": "j", "mode": "pairs"}})
    with pytest.raises(ValueError, match="reward.judge: judged rewards are single-agent"):
        RLConfig(env={"name": "calc_relay"}, roles={"planner": {}, "solver": {}},
                 reward={"judge": {"base_url": "http://x/v1", "model": "j"}})


class ScriptedJudgeEngine:
    """A token engine behind ``tracegym serve`` that answers every judge prompt with a rubric score:
    ``score(prompt text)``, by default one that varies with the episode (so groups carry signal)."""

    name = "scripted-judge"
    returns_logprobs = True

    def __init__(self, renderer, score=None):
        self.renderer, self.calls = renderer, 0
        self.score = score or (lambda text: (len(text) % 3) / 2)

    def generate(self, prompts, params):
        from tracegym.types import Generation

        out = []
        for prompt in prompts:
            self.calls += 1
            score = self.score(self.renderer.tokenizer.decode(prompt))
            ids = self.renderer.encode_text('{"reason": "scripted", "score": %s}' % score) + [self.renderer.stop_token_ids[0]]
            out.append([Generation(token_ids=tuple(ids), logprobs=tuple(-0.1 for _ in ids))])
        return out


def test_rl_trains_on_a_judge_served_by_tracegym_on_loopback(tmp_path, monkeypatch):
    from tracegym.config import RLConfig
    from tracegym.models import load
    from tracegym.recipes.rl import train_rl
    from tracegym.render import get_renderer
    from tracegym.serve import Gateway

    _, tokenizer = load("tiny-random")
    renderer = get_renderer("tiny-random", tokenizer)
    engine = ScriptedJudgeEngine(renderer)
    with Gateway(engine, renderer, "judge") as server:
        monkeypatch.setenv("JUDGE_KEY", server.api_key)
        cfg = RLConfig(model={"name": "tiny-random"}, lora={"r": 4}, env={"name": "calculator", "options": {"num_calls": 1}},
                       tasks={"train": 4, "test": 1}, tasks_per_step=2, group_size=3, steps=2,
                       rollout={"max_tokens_per_turn": 6}, eval={"at_start": False, "every": 0}, save_rollouts=True,
                       output_dir=str(tmp_path / "run"), logging={"progress": False, "tensorboard": False},
                       reward={"judge": {"base_url": server._thread.url + "/v1", "model": "judge", "api_key_env": "JUDGE_KEY",
                                         "verifiable_weight": 0.0}})
        result = train_rl(cfg)
    rows = [r for r in result.history if "judge/calls" in r]
    assert len(rows) == 2 and all(r["judge/calls"] == 6.0 and r["judge/parse_failures"] == 0.0 for r in rows)
    assert all(r["judge/tokens"] > 0 and r["judge/dropped_groups"] == 0.0 for r in rows)
    assert engine.calls == 12 and (tmp_path / "run" / "judge_cache.jsonl").is_file()
    assert result.final_dir is not None and (result.final_dir / "adapter_config.json").is_file()
    # the key reached the judge, never the logs
    logged = (tmp_path / "run" / "metrics.jsonl").read_text() + (tmp_path / "run" / "config.yaml").read_text()
    assert os.environ["JUDGE_KEY"] not in logged


def test_the_judge_command_measures_agreement_with_the_rewards(tmp_path, monkeypatch, capsys):
    from tracegym.cli import main
    from tracegym.models import load
    from tracegym.render import get_renderer
    from tracegym.serve import Gateway

    _, tokenizer = load("tiny-random")
    renderer = get_renderer("tiny-random", tokenizer)
    source = tmp_path / "trajectories.jsonl"
    source.write_text("".join(t.model_dump_json() + "\n" for g in _groups() for t in g.trajectories))
    engine = ScriptedJudgeEngine(renderer, score=lambda text: 1.0 if "<answer>42</answer>" in text else 0.0)
    with Gateway(engine, renderer, "judge") as server:
        monkeypatch.setenv("JUDGE_KEY", server.api_key)
        args = ["judge", str(source), "--base-url", server._thread.url + "/v1", "--model", "judge",
                "--api-key-env", "JUDGE_KEY", "--out", str(tmp_path / "out")]
        assert main(args) == 0
        summary = json.loads((tmp_path / "out" / "judge.json").read_text())
        assert main(args) == 0  # again: every reply from the cache
    again = json.loads((tmp_path / "out" / "judge.json").read_text())
    a = summary["agreement"]
    assert (a["episodes"], a["tasks"], a["pairs"]) == (6, 2, 4)
    assert a["spearman"] == pytest.approx(1.0) and a["pairwise_accuracy"] == 1.0
    assert summary["calls"] == 6.0 and summary["tokens"] > 0 and summary["parse_failures"] == 0.0
    assert (again["calls"], again["cache_hits"], again["tokens"]) == (0.0, 6.0, 0.0) and engine.calls == 6
    judged = [json.loads(line) for line in (tmp_path / "out" / "judged.jsonl").read_text().splitlines()]
    assert [j["info"]["judge"]["score"] for j in judged] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert "Spearman 1.000" in capsys.readouterr().out
    assert main(["judge", str(tmp_path / "missing.jsonl"), "--base-url", "http://x/v1", "--model", "j", "--out", str(tmp_path / "o")]) == 2
