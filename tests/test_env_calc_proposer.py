"""The calc_proposer env: seeds, every validity rule, the learnability reward, the expert's
proposals (valid, and solved by the calculator's expert as solver tasks), recovering proposals."""

from __future__ import annotations

import asyncio

import pytest

from tracegym.envs import make
from tracegym.envs.check import check_env
from tracegym.envs.episode import run_episode, run_episodes
from tracegym.environments.calc_proposer import (
    REASONS,
    CalcProposerEnv,
    check_proposal,
    compose_templates,
    learnability_reward,
    proposal_from_messages,
    solver_task,
)
from tracegym.environments.calculator import CalculatorEnv
from tracegym.types import Message, ToolCall

Q = "A shop has 37 boxes of 24 pens each. It sells 129 pens. How many pens are there now?"


def _propose(question: str, expression: str, call_id: str | None = "p") -> Message:
    return Message(role="assistant", tool_calls=(
        ToolCall(name="propose", arguments={"question": question, "expression": expression}, id=call_id),))


def test_make_and_options() -> None:
    env = make("calc_proposer")
    assert isinstance(env, CalcProposerEnv)
    assert (env.min_calls, env.max_calls, env.max_turns) == (1, 3, 3)
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["propose"]
    assert env.tool_schemas()[0]["function"]["parameters"]["required"] == ["question", "expression"]
    assert make("calc_proposer", num_calls=2).max_calls == 2
    for bad in (0, 7, "x", (3, 1)):
        with pytest.raises(ValueError):
            make("calc_proposer", num_calls=bad)


def test_seeds_deterministic_and_splits_disjoint() -> None:
    env = CalcProposerEnv()
    train, test = env.tasks("train", 100, seed=0), env.tasks("test", 40, seed=0)
    assert train == CalcProposerEnv().tasks("train", 100, seed=0)
    assert train != env.tasks("train", 100, seed=1)
    assert len({t.id for t in train}) == 100 and all(t.split == "train" for t in train)
    assert all(t.split == "test" for t in test)
    assert not {t.id for t in train} & {t.id for t in test}
    assert not {t.data["prompt"] for t in train} & {t.data["prompt"] for t in test}
    assert {t.data["num_calls"] for t in train} == {1, 2, 3}
    a, b = train[0].data["start"]
    prompt = train[0].data["prompt"]
    assert prompt.startswith(f"Write a new arithmetic word problem about {train[0].data['topic']} that needs ")
    assert f" {a} " in prompt and f" {b} " in prompt and "Call propose(question, expression)" in prompt
    # The expert's reference problem is privileged: never in the prompt.
    assert train[0].data["reference"]["question"] not in prompt


def test_a_valid_proposal() -> None:
    check = check_proposal(Q, "37 * 24 - 129", 1)
    assert check.valid and check.reason == 0 and check.operators == 2 and check.answer == 759
    assert check_proposal(Q, "(37 * 24) - 129", 2).valid
    assert check_proposal("Split 12,345 coins among 5 friends and 10 more people: each share?", "12,345 // (5 + 10)", 1).valid
    even = check_proposal("A box holds 12 eggs shared by 6 friends. How many each?", "12 / 6", 1)
    assert even.valid and even.answer == 2  # a true division with a whole result counts


@pytest.mark.parametrize(
    "question, expression, k, reason",
    [
        ("A shop has 37 boxes of 24 pens each, that is 888 pens. How many pens?", "37 * 24", 1, 8),  # giveaway
        ("A shop has 37 boxes of 24 pens each. It sells 88 pens and keeps 800. How many are left?", "37 * 24 - 88", 1, 8),
        ("A shop has 37 boxes of 24 pens each, 888 in all. How many pens?", "-(37 * 24)", 1, 8),  # |answer| counts
        ("Twelve is 6 pairs of 2 socks. How many socks per pair then?", "12 / 6", 1, 7),  # numbers in digits only
        ("A shop has 37 boxes of pens each. How many pens are there now?", "37 * 24", 1, 7),  # 24 missing
        (Q, "37 * 24 - 129 + 1 - 1", 1, 5),  # 4 operators > 3 * 1
        (Q, "37", 1, 5),  # no operator: nothing to calculate
        ("A shop has 7 cakes for 2 people. How much cake per person?", "7 / 2", 1, 3),  # 3.5
        ("A shop has 7 cakes for 0 people. How much cake per person?", "7 / 0", 1, 2),  # division by zero
        ("A shop has 7 cakes for 0 people. How much cake per person?", "7 % 0", 1, 2),
        ("A shop has 99999 boxes of 99999 pens. How many pens are there?", "99999 * 99999", 1, 4),  # too large
        ("Short 3 * 4?", "3 * 4", 1, 6),  # question too short
        ("A shop has 3 boxes of 4 pens each. " * 12 + "How many pens?", "3 * 4", 1, 6),  # too long
        ("What is 37 * 24 in total for this shop's pens?", "37 * 24", 1, 9),  # the expression verbatim
        ("What is 37*24 in total for this shop's pens?", "37 * 24", 1, 9),
        (Q, "37 * x", 1, 1),  # does not evaluate
        (Q, "__import__('os')", 1, 1),
    ],
)
def test_validity_rules(question: str, expression: str, k: int, reason: int) -> None:
    check = check_proposal(question, expression, k)
    assert not check.valid and check.reason == reason, (check, REASONS[reason])


def test_operator_limit_scales_with_calculations() -> None:
    expression = "37 * 24 - 129 + 1 - 1"  # 4 operators
    assert check_proposal(Q.replace("pens.", "pens. It gets 1 more and loses 1."), expression, 2).valid
    assert check_proposal(Q.replace("pens.", "pens. It gets 1 more and loses 1."), expression, 1).reason == 5


@pytest.mark.parametrize("valid, p, reward", [(True, 0.5, 1.0), (True, 0.0, 0.0), (True, 1.0, 0.0), (True, 0.25, 0.75),
                                               (True, 0.75, 0.75), (False, 0.5, 0.0), (False, 0.25, 0.0)])
def test_learnability_reward(valid: bool, p: float, reward: float) -> None:
    assert learnability_reward(valid, p) == pytest.approx(reward)


def test_learnability_reward_refuses_bad_rates() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            learnability_reward(True, bad)


def test_compose_templates() -> None:
    assert compose_templates(["15 * 51"]) == "15 * 51"
    assert compose_templates(["15 * 51", "{x} // 36", "{x} * 46"]) == "((15 * 51) // 36) * 46"
    with pytest.raises(ValueError):
        compose_templates([])


def test_episode_rewards_and_info() -> None:
    async def go(*messages: Message, errors: tuple[str, ...] = ()) -> list:
        env = CalcProposerEnv(num_calls=1)
        await env.reset(env.tasks("train", 1)[0])
        out = [await env.step(Message(role="assistant"), errors)] if errors else []
        for m in messages:
            out.append(await env.step(m))
        return out

    [ok] = asyncio.run(go(_propose(Q, "37 * 24 - 129")))
    assert ok.terminated and ok.reward == 1.0 and ok.messages[0].content == "Accepted."
    assert (ok.info["valid"], ok.info["reason"], ok.info["operators"], ok.info["success"]) == (1, 0, 2, 1)
    assert ok.info["proposal"] == {"question": Q, "expression": "37 * 24 - 129", "answer": 759, "valid": 1}
    [bad] = asyncio.run(go(_propose(Q, "7 / 0")))
    assert bad.terminated and bad.reward == 0.0 and bad.messages[0].content == f"Rejected: {REASONS[2]}."
    assert (bad.info["valid"], bad.info["reason"], bad.info["success"]) == (0, 2, 0)
    [silent] = asyncio.run(go(Message(role="assistant", content="Here is a problem: ...")))
    assert silent.terminated and silent.reward == 0.0 and silent.info["reason"] == 10
    parse, after = asyncio.run(go(_propose(Q, "37 * 24 - 129"), errors=("bad JSON",)))
    assert not parse.terminated and parse.messages[0].content == "Error: bad JSON" and after.reward == 1.0


def test_expert_proposals_are_valid_and_solvable() -> None:
    tasks = CalcProposerEnv().tasks("train", 60, seed=0) + CalcProposerEnv(num_calls="4..6").tasks("test", 20, seed=0)
    trajectories = asyncio.run(run_episodes(lambda: make("calc_proposer", num_calls="1..6"), tasks, lambda env: env.expert_action))
    assert all(t.reward == 1.0 and t.success and t.metrics["valid"] == 1.0 for t in trajectories)

    for i, (task, trajectory) in enumerate(zip(tasks, trajectories)):
        proposal = proposal_from_messages(trajectory.messages)
        reference = task.data["reference"]
        assert proposal == {k: reference[k] for k in ("question", "expression", "answer")}
        solver = solver_task(proposal, f"prop-{i}")
        assert solver.data["question"] == proposal["question"] and solver.data["answer"] == proposal["answer"]
        env = CalculatorEnv()
        played = asyncio.run(run_episode(env, solver, env.expert_action))
        assert played.reward == 1.0 and played.success, (proposal, played.messages)


def test_proposal_from_messages() -> None:
    accepted = [Message(role="system", content="s"), Message(role="user", content="u"), _propose(Q, "37 * 24 - 129"),
                Message(role="tool", content="Accepted.", tool_call_id="p", name="propose")]
    assert proposal_from_messages(accepted) == {"question": Q, "expression": "37 * 24 - 129", "answer": 759}
    rejected = accepted[:3] + [Message(role="tool", content=f"Rejected: {REASONS[8]}.", tool_call_id="p", name="propose")]
    assert proposal_from_messages(rejected) is None
    assert proposal_from_messages(accepted[:3]) is None  # never answered
    assert proposal_from_messages([]) is None
    # Calls without ids pair with the named tool replies in order (a parse-error reply has no name).
    two = Message(role="assistant", tool_calls=(
        ToolCall(name="propose", arguments={"question": Q, "expression": "37 * 24"}),
        ToolCall(name="propose", arguments={"question": Q, "expression": "37 * 24 - 129"})))
    replies = [Message(role="tool", content="Error: bad JSON"),
               Message(role="tool", content="Rejected: the question gives the answer away.", name="propose"),
               Message(role="tool", content="Accepted.", name="propose")]
    assert proposal_from_messages([two, *replies])["expression"] == "37 * 24 - 129"


def test_proposal_round_trip_through_the_env() -> None:
    async def go():
        env = CalcProposerEnv(num_calls=1)
        task = env.tasks("test", 1)[0]
        return await run_episode(env, task, lambda: _propose(Q, "(37 * 24) - 129", call_id=None))

    trajectory = asyncio.run(go())
    assert trajectory.reward == 1.0 and trajectory.metrics["operators"] == 2.0
    proposal = proposal_from_messages(trajectory.messages)
    assert proposal == {"question": Q, "expression": "(37 * 24) - 129", "answer": 759}
    task = solver_task(proposal, "calc-prop-1")
    assert task.id == "calc-prop-1" and task.split == "train"
    assert task.data["templates"] == ["(37 * 24) - 129"] and task.data["answer"] == 759


def test_solver_task_refuses_bad_proposals() -> None:
    with pytest.raises(ValueError):
        solver_task({"question": Q, "expression": "7 / 2"}, "x")
    with pytest.raises(ValueError):
        solver_task({"question": Q, "expression": "37 * 24", "answer": 1}, "x")
    with pytest.raises(ZeroDivisionError):
        solver_task({"question": Q, "expression": "1 / 0"}, "x")


def test_check_env_passes() -> None:
    report = check_env("calc_proposer", n_tasks=20)
    assert report.ok and report.expert_success_rate == 1.0
