"""Test-time learning across attempts (``tracegym eval --attempts N --reflect``): a failed episode
is retried on its task and the retry sees the earlier outcomes (and the model's reflection);
pass@(attempt) counts chains solved within a attempts."""

from __future__ import annotations

import asyncio
import json

import pytest

from tracegym.rollout import RolloutConfig
from tracegym.rollout.attempts import FEEDBACK_KEY, REFLECT_REQUEST, FeedbackEnv, pass_at_attempts, run_attempts
from tracegym.types import Generation, Message, Trajectory


@pytest.fixture(scope="module")
def renderer():
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer

    return get_renderer("tiny-random", load_tokenizer("tiny-random"))


class Learner:
    """A token engine that answers wrong (-1) until its prompt shows an earlier attempt, then right;
    asked to reflect, it writes ``LESSON``. It records every prompt it saw."""

    name = "learner"
    returns_logprobs = True
    LESSON = "I answered -1 without computing."

    def __init__(self, renderer, answers, needs_lesson=False):
        self.renderer, self.answers, self.needs_lesson, self.prompts = renderer, answers, needs_lesson, []

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            text = self.renderer.tokenizer.decode(prompt)
            self.prompts.append(text)
            if REFLECT_REQUEST in text[-400:]:
                reply = self.LESSON
            else:
                question = next(q for q in self.answers if q in text)
                knows = "Earlier attempts" in text and (not self.needs_lesson or self.LESSON in text)
                reply = f"<answer>{self.answers[question] if knows else -1}</answer>"
            ids = self.renderer.encode_text(reply) + [self.renderer.stop_token_ids[0]]
            out.append([Generation(token_ids=tuple(ids), logprobs=tuple(-0.1 for _ in ids))])
        return out


def _tasks(n=3):
    from tracegym.envs import make

    return make("calculator", num_calls=1).tasks("test", n)


@pytest.mark.parametrize("reflect", [False, True])
def test_a_retry_sees_the_earlier_outcome_and_solves(renderer, reflect):
    tasks = _tasks()
    engine = Learner(renderer, {t.data["question"]: t.data["answer"] for t in tasks}, needs_lesson=reflect)
    config = RolloutConfig(samples_per_task=2, max_turns=2, max_context=None, seed=3)
    tried = asyncio.run(run_attempts("calculator", tasks, engine, renderer, config, 3, reflect=reflect,
                                     env_options={"num_calls": 1}))
    assert len(tried.chains) == 6 and all(len(c) == 2 for c in tried.chains)  # fail, then solve: no third attempt
    assert [c[0].task_id for c in tried.chains] == [t.id for t in tasks for _ in range(2)]
    assert [c[0].sample_index for c in tried.chains] == [0, 1] * 3
    for chain in tried.chains:
        first, second = chain
        assert not first.success and second.success and second.sample_index == first.sample_index
        assert (first.info["attempt"], second.info["attempt"]) == (1, 2) and second.task_id == first.task_id
        opening = [m for m in second.messages if m.role == "user"][0].content
        assert "Attempt 1 did not solve this task (reward 0.00" in opening and "<answer>-1</answer>" in opening
        assert (Learner.LESSON in opening) == reflect
    assert tried.reflections == ([[Learner.LESSON]] * 6 if reflect else [[]] * 6)
    assert (tried.reflection_tokens > 0) == reflect
    table = pass_at_attempts(tried.chains, 3)
    assert [table[a]["value"] for a in ("1", "2", "3")] == [0.0, 1.0, 1.0]


def test_pass_at_attempt_averages_chains_per_task():
    def traj(task, success):
        return Trajectory(env="e", task_id=task, messages=(), success=success, reward=float(success))

    chains = [[traj("a", False), traj("a", True)], [traj("a", True)],  # task a: 1/2 then 2/2
              [traj("b", False), traj("b", False), traj("b", False)], [traj("b", False), traj("b", False), traj("b", True)]]
    table = pass_at_attempts(chains, 3, n_bootstrap=200)
    assert [table[a]["value"] for a in ("1", "2", "3")] == [0.25, 0.5, 0.75]
    low, high = table["3"]["ci"]
    assert low <= 0.75 <= high and low >= 0.5


def test_the_feedback_env_appends_to_the_opening_user_message_only():
    from tracegym.envs import make

    task = _tasks(1)[0]
    env = FeedbackEnv(make("calculator", num_calls=1))
    plain = asyncio.run(env.reset(task))
    assert plain == asyncio.run(make("calculator", num_calls=1).reset(task))
    noted = asyncio.run(env.reset(task.model_copy(update={"data": {**task.data, FEEDBACK_KEY: "Attempt 1: no."}})))
    assert noted[-1].content == f"{plain[-1].content}\n\nEarlier attempts at this task:\nAttempt 1: no.\nTry again."
    assert [m.role for m in noted] == [m.role for m in plain]
    assert env.branch_refusal()


def test_eval_attempts_writes_pass_at_attempt(renderer, tmp_path, monkeypatch):
    from tracegym.recipes.evaluate import evaluate_to_dir

    tasks = _tasks(2)
    engine = Learner(renderer, {t.data["question"]: t.data["answer"] for t in tasks})
    config = RolloutConfig(samples_per_task=2, max_turns=2, max_context=None)
    summary, result, _ = evaluate_to_dir("calculator", tasks, engine, renderer, config, [1, 2], [1, 2], tmp_path,
                                         env_options={"num_calls": 1}, attempts=2, plots=False, bootstrap=100)
    assert summary["pass_at"]["2"]["1"] == 0.0  # pass@k counts the first attempts only
    assert summary["attempts"]["pass_at_attempt"]["2"]["value"] == 1.0 and summary["attempts"]["played"] == {"1": 4, "2": 4}
    later = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    assert len(later) == 4 and all(t["success"] and t["info"]["attempt"] == 2 for t in later)
    assert len((tmp_path / "trajectories.jsonl").read_text().splitlines()) == 4
    with pytest.raises(ValueError, match="attempts"):
        evaluate_to_dir("calculator", tasks, engine, renderer, config, [1], [1, 2], tmp_path / "x", attempts=2,
                        strategy="tree")


def test_the_attempts_flags_are_checked(tmp_path, capsys):
    from tracegym.cli import main

    assert main(["eval", "--env", "calculator", "--policy", "expert", "--reflect", "--out", str(tmp_path)]) == 2
    assert "--reflect needs --attempts" in capsys.readouterr().err
    assert main(["eval", "--env", "calculator", "--policy", "expert", "--attempts", "2", "--reflect",
                 "--out", str(tmp_path)]) == 2
    assert "needs a model" in capsys.readouterr().err
    assert main(["eval", "--env", "calculator", "--attempts", "2", "--strategy", "tree", "--out", str(tmp_path)]) == 2
    assert "--attempts" in capsys.readouterr().err


def test_expert_attempts_stop_at_the_first_success(renderer, tmp_path):
    from tracegym.cli import main

    out = tmp_path / "e"
    assert main(["eval", "--env", "calculator", "--policy", "expert", "--attempts", "3", "--tasks", "3",
                 "--samples", "1", "--k", "1", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "eval.json").read_text())
    assert summary["attempts"]["played"] == {"1": 3, "2": 0, "3": 0}
    assert summary["attempts"]["pass_at_attempt"]["1"]["value"] == 1.0
    assert (out / "attempts.jsonl").read_text() == ""


def test_a_transcript_too_long_for_the_context_gets_no_reflection(renderer):
    from tracegym.rollout.attempts import _reflections
    from tracegym.types import SamplingParams

    tasks = _tasks(1)
    engine = Learner(renderer, {t.data["question"]: t.data["answer"] for t in tasks})
    config = RolloutConfig(samples_per_task=1, max_turns=2, max_context=None)
    tried = asyncio.run(run_attempts("calculator", tasks, engine, renderer, config, 1, env_options={"num_calls": 1}))
    failed = [tried.chains[0][0]]
    params = SamplingParams(max_tokens=16, stop_token_ids=tuple(renderer.stop_token_ids))
    assert _reflections(engine, renderer, failed, params, None)[0] == [Learner.LESSON]
    assert _reflections(engine, renderer, failed, params, 20) == ([""], 0)  # the prompt alone is longer
