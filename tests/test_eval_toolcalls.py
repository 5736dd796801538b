"""Tool-call scores on hand-made trajectories: strict matching and the invalid-call rate."""

from __future__ import annotations

import pytest

from tracegym.eval.evaluate import summarize
from tracegym.eval.toolcalls import (
    call_key,
    invalid_call_stats,
    normalize_arguments,
    predicted_call_turns,
    reference_call_stats,
    reference_turns,
)
from tracegym.types import Message, ToolCall, Trajectory, Turn

TOOLS = (
    {"type": "function", "function": {"name": "search", "parameters": {}}},
    {"type": "function", "function": {"name": "open", "parameters": {}}},
)


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def episode(turns: list[tuple[list[ToolCall], list[str], list[str]]], reference=None, *, with_turns: bool = True,
            task: str = "t", index: int = 0) -> Trajectory:
    """``turns``: per assistant turn (calls, parse errors, tool result texts in call order)."""
    messages = [Message(role="user", content="q")]
    turn_objs = []
    for n, (calls, errors, results) in enumerate(turns):
        calls = [c.model_copy(update={"id": f"{n}-{i}"}) for i, c in enumerate(calls)]
        msg = Message(role="assistant", content="", tool_calls=tuple(calls))
        env = [Message(role="tool", content=text, tool_call_id=f"{n}-{i}", name=calls[i].name if i < len(calls) else None)
               for i, text in enumerate(results)]
        messages += [msg, *env]
        turn_objs.append(Turn(prompt_ids=(1,), completion_ids=(2,), message=msg, parse_errors=tuple(errors),
                              env_messages=tuple(env)))
    info = {} if reference is None else {"reference_calls": reference}
    return Trajectory(env="search", task_id=task, sample_index=index, messages=tuple(messages),
                      turns=tuple(turn_objs) if with_turns else (), tools=TOOLS, info=info)


def ref(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


def test_normalize_arguments() -> None:
    assert normalize_arguments({"b": 1, "a": "  Paris  France "}) == normalize_arguments({"a": "paris france", "b": 1.0})
    assert normalize_arguments({"x": "3"}) == normalize_arguments({"x": 3})
    assert normalize_arguments({"x": 1, "y": None}) == normalize_arguments({"x": 1})
    assert normalize_arguments({"x": True}) != normalize_arguments({"x": 1})
    assert normalize_arguments({"x": [1, 2]}) != normalize_arguments({"x": [2, 1]})
    assert normalize_arguments({"x": {"q": "A"}}) == normalize_arguments({"x": {"q": "a"}})
    assert normalize_arguments({"q": "paris"}) != normalize_arguments({"q": "london"})
    assert call_key(" search", {}) == call_key("search", {})
    with pytest.raises(TypeError):
        normalize_arguments(["not", "a", "dict"])  # type: ignore[arg-type]


def test_perfect_episode() -> None:
    traj = episode(
        [([call("search", q="Eiffel tower")], [], ["doc1"]), ([call("open", id=3)], [], ["text"]), ([], [], [])],
        reference=[ref("search", q="eiffel  tower"), ref("open", id="3")],
    )
    stats = reference_call_stats([traj])
    assert stats is not None
    d = stats.to_dict()
    assert d["call_precision"] == d["call_recall"] == d["call_f1"] == 1.0
    assert d["turn_accuracy"] == d["turn_precision"] == d["conversation_exact_match"] == 1.0
    assert (d["predicted_turns"], d["reference_turns"]) == (2, 2)  # the final answer turn has no calls


def test_partial_episode_hand_computed() -> None:
    # predicted: turn 1 search(q=a), search(q=a) [parallel]; turn 2 open(id=1); turn 3 malformed
    # reference: turn 1 search(q=a); turn 2 open(id=2); turn 3 search(q=b)
    traj = episode(
        [([call("search", q="a"), call("search", q="a")], [], ["r", "r"]),
         ([call("open", id=1)], [], ["r"]),
         ([], ["bad json"], [])],
        reference=[ref("search", q="a"), ref("open", id=2), ref("search", q="b")],
    )
    assert predicted_call_turns(traj)[2] == [None]
    d = reference_call_stats([traj]).to_dict()
    # calls: 4 predicted (the malformed one included), 3 reference, 1 match (search a, counted once)
    assert (d["predicted_calls"], d["reference_calls"], d["matched_calls"]) == (4, 3, 1)
    assert d["call_precision"] == pytest.approx(1 / 4) and d["call_recall"] == pytest.approx(1 / 3)
    assert d["call_f1"] == pytest.approx(2 * (1 / 4) * (1 / 3) / (1 / 4 + 1 / 3))
    # turn 1 {a, a} != {a}; turn 2 wrong id; turn 3 malformed
    assert d["matched_turns"] == 0 and d["conversation_exact_match"] == 0.0


def test_parallel_reference_turns_and_aggregation() -> None:
    nested = [[ref("search", q="x"), ref("search", q="y")], [ref("open", id=1)]]
    good = episode([([call("search", q="y"), call("search", q="x")], [], ["1", "2"]), ([call("open", id=1)], [], ["t"])],
                   reference=nested, task="a")
    extra = episode([([call("search", q="x"), call("search", q="y")], [], ["1", "2"]), ([call("open", id=1)], [], ["t"]),
                     ([call("open", id=1)], [], ["t"])], reference=nested, task="b")
    no_ref = episode([([call("search", q="zzz")], [], ["1"])], task="c")
    assert reference_turns(good) == [[call_key("search", {"q": "x"}), call_key("search", {"q": "y"})],
                                     [call_key("open", {"id": 1})]]
    assert reference_turns(no_ref) is None
    d = reference_call_stats([good, extra, no_ref]).to_dict()
    assert d["episodes"] == 2  # the episode without references is left out
    # micro average: matched 3 + 3, predicted 3 + 4, reference 3 + 3
    assert d["call_precision"] == pytest.approx(6 / 7) and d["call_recall"] == 1.0
    assert d["turn_accuracy"] == 1.0 and d["turn_precision"] == pytest.approx(4 / 5)
    assert d["conversation_exact_match"] == 0.5  # the extra call turn breaks exact match
    assert reference_call_stats([no_ref]) is None


def test_bad_reference_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="must be a list"):
        reference_turns(episode([], reference="search(q=a)"))
    with pytest.raises(ValueError, match="'name'"):
        reference_turns(episode([], reference=[{"arguments": {}}]))


def test_invalid_call_rate() -> None:
    traj = episode(
        [([call("search", q="a")], [], ["Error: missing argument 'q'"]),  # answered with an error
         ([call("delete_db")], ["bad json", "unclosed tag"], ["Error: unknown tool delete_db"]),  # unknown + 2 malformed
         ([call("open", id=1), call("search", q="b")], [], ["page", "  error: timeout"]),  # 1 error result
         ([], [], [])],
    )
    s = invalid_call_stats([traj]).to_dict()
    assert s["attempted_calls"] == 1 + 3 + 2
    assert s["parse_errors"] == 2 and s["unknown_tool_calls"] == 1 and s["error_results"] == 2
    assert s["invalid_calls"] == 5 and s["invalid_call_rate"] == pytest.approx(5 / 6)
    assert s["assistant_turns"] == 4 and s["turns_with_parse_errors"] == 1
    assert s["parse_error_turn_rate"] == pytest.approx(1 / 4)


def test_invalid_calls_from_messages_only() -> None:
    # Without token-exact turns the tool results come from the message list (parse errors unknown).
    traj = episode([([call("search", q="a")], [], ["Error: no results"]), ([call("open", id=2)], [], ["ok"])],
                   with_turns=False)
    s = invalid_call_stats([traj]).to_dict()
    assert (s["attempted_calls"], s["error_results"], s["assistant_turns"]) == (2, 1, 2)
    assert s["invalid_call_rate"] == 0.5


def test_results_paired_by_id_not_position() -> None:
    msg = Message(role="assistant", tool_calls=(ToolCall(name="search", arguments={"q": "a"}, id="A"),
                                                ToolCall(name="open", arguments={"id": 1}, id="B")))
    env = (Message(role="tool", content="page", tool_call_id="B"), Message(role="tool", content="Error: x", tool_call_id="A"))
    traj = Trajectory(env="e", task_id="t", messages=(Message(role="user", content="q"), msg, *env), tools=TOOLS,
                      turns=(Turn(prompt_ids=(1,), completion_ids=(2,), message=msg, env_messages=env),))
    assert invalid_call_stats([traj]).error_results == 1
    # no tools listed: no call can be judged unknown
    assert invalid_call_stats([traj.model_copy(update={"tools": ()})]).unknown_tool_calls == 0


def test_summarize_reports_tool_calls() -> None:
    reference = [ref("search", q="a")]
    trajs = [
        episode([([call("search", q="a")], [], ["r"])], reference, task="x", index=0),
        episode([([call("search", q="b")], [], ["Error: nothing"])], reference, task="x", index=1),
    ]
    s = summarize(trajs, ks=[1, 2], n_bootstrap=20)
    assert s["tool_calls"]["call_precision"] == 0.5 and s["tool_calls"]["conversation_exact_match"] == 0.5
    assert s["invalid_calls"]["invalid_call_rate"] == 0.5
