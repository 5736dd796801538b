"""Why tool calls fail (``tracegym.render.call_errors``): the reason of every failed call attempt.

- golden: hand-written completions, tokenized with each family's fixture tokenizer (the embedded
  SmolLM2 for ``smollm2``/``hermes``, tests/fetch_tokenizers.py for the others), give exactly the
  expected ``bad_json`` / ``unknown_tool`` / ``bad_args`` / ``truncated`` / ``other`` counts, and
  every error text alone (what a trajectory read back from JSON keeps) gives the same reason;
- plugin renderers: the example plugin's errors and a plugin's own plain strings are classified;
- the episode loop counts the reasons as ``parse_errors/<reason>`` metrics while the env still
  answers every failed call with an error;
- eval.json sums them per call attempt (also for trajectories written before the metrics existed)
  and the HTML report shows the table.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fetch_tokenizers import load_for_test

from tracegym.envs import Task, ToolEnv, tool
from tracegym.envs.episode import Action, Observation, TokenData, play_episode
from tracegym.eval.evaluate import load_eval, summarize, write_eval
from tracegym.eval.report import call_failure_rows, render_report
from tracegym.eval.toolcalls import call_failure_stats
from tracegym.render import get_renderer
from tracegym.render.base import Renderer
from tracegym.render.call_errors import (
    FAILURE_METRIC_PREFIX,
    error_reason,
    failure_metrics,
    reason_from_text,
    schema_failure,
    turn_failures,
)
from tracegym.render.conformance import ADD_TOOL
from tracegym.render.smollm2 import SmolLM2Renderer
from tracegym.types import CALL_FAILURE_REASONS, CallError, Message, ParsedCompletion, ToolCall, Trajectory, TrajectoryGroup

EXAMPLE_PLUGIN = str(Path(__file__).resolve().parent.parent / "examples" / "plugins" / "bracket_renderer.py")

# add(a: int, b: int), both required; lookup(key: str) with no other argument allowed
LOOKUP_STRICT: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"],
                       "additionalProperties": False},
    },
}
TOOLS = (ADD_TOOL, LOOKUP_STRICT)


def _tag(body: str, close: bool = True) -> str:
    return f"<tool_call>\n{body}" + ("\n</tool_call>" if close else "")


# (case, text, ended with the stop token, expected failures) for the <tool_call> families
TAG_CASES = [
    ("valid", _tag('{"name": "add", "arguments": {"a": 1, "b": 2}}'), True, {}),
    ("bad_json", _tag('{"name": "add", "arguments": {"a": 1,}}'), True, {"bad_json": 1}),
    ("bad_json_not_object", _tag('["add", {"a": 1}]'), True, {"bad_json": 1}),
    ("bad_json_no_name", _tag('{"arguments": {"a": 1, "b": 2}}'), True, {"bad_json": 1}),
    ("bad_json_ended_inside_call", "Adding. " + _tag('{"name": "add", "arguments": {"a": 1', close=False), True,
     {"bad_json": 1}),
    ("truncated", "Adding. " + _tag('{"name": "add", "arguments": {"a": 1', close=False), False, {"truncated": 1}),
    ("unknown_tool", _tag('{"name": "multiply", "arguments": {"a": 1, "b": 2}}'), True, {"unknown_tool": 1}),
    ("bad_args_missing", _tag('{"name": "add", "arguments": {"a": 1}}'), True, {"bad_args": 1}),
    ("bad_args_type", _tag('{"name": "add", "arguments": {"a": "1", "b": 2}}'), True, {"bad_args": 1}),
    ("bad_args_extra", _tag('{"name": "lookup", "arguments": {"key": "x", "limit": 3}}'), True, {"bad_args": 1}),
    ("bad_args_not_object", _tag('{"name": "add", "arguments": [1, 2]}'), True, {"bad_args": 1}),
    ("bad_args_string_not_object", _tag('{"name": "add", "arguments": "a=1"}'), True, {"bad_args": 1}),
    ("other_stray_close", "Done.\n</tool_call>", True, {"other": 1}),
    ("mixed_then_cut", "\n".join([_tag('{"name": "add", "arguments": {"a": 1, "b": 2}}'), _tag("not json"),
                                  _tag('{"name": "nope", "arguments": {}}'), _tag('{"name": "add', close=False)]),
     False, {"bad_json": 1, "unknown_tool": 1, "truncated": 1}),
]

# the same for Llama 3's JSON call lines
JSON_CASES = [
    ("valid", '{"name": "add", "parameters": {"a": 1, "b": 2}}', True, {}),
    ("bad_json", '{"name": "add", "parameters": {"a": 1,}}', True, {"bad_json": 1}),
    ("bad_json_no_name", '{"parameters": {"a": 1, "b": 2}}', True, {"bad_json": 1}),
    ("bad_json_ended_inside_call", '{"name": "add", "parameters": {"a": 1', True, {"bad_json": 1}),
    ("truncated", '{"name": "add", "parameters": {"a": 1', False, {"truncated": 1}),
    ("truncated_in_string", 'Sure.\n{"name": "add", "parameters": {"a": "1', False, {"truncated": 1}),
    ("unknown_tool", '{"name": "multiply", "parameters": {"a": 1, "b": 2}}', True, {"unknown_tool": 1}),
    ("bad_args_missing", '{"name": "add", "parameters": {"a": 1}}', True, {"bad_args": 1}),
    ("bad_args_extra", '{"name": "lookup", "parameters": {"key": "x", "limit": 3}}', True, {"bad_args": 1}),
    ("bad_args_not_object", '{"name": "add", "parameters": [1]}', True, {"bad_args": 1}),
    ("bad_args_string_not_object", '{"name": "add", "parameters": "a=1"}', True, {"bad_args": 1}),
    ("other_text_after", '{"name": "add", "parameters": {"a": 1, "b": 2}} and then text', True, {"other": 1}),
    ("mixed_then_cut", '{"name": "nope", "parameters": {}}; {"name": "add", "parameters": {"a": 1}}\n{"name": "add"',
     False, {"unknown_tool": 1, "bad_args": 1, "truncated": 1}),
]

QWEN3_THINKING = "<think>\nLet me add.\n</think>\n\n"
FAMILIES = {  # family -> (fixture tokenizer, cases, prefix of every completion)
    "smollm2": ("smollm2", TAG_CASES, ""),
    "hermes": ("smollm2", TAG_CASES, ""),
    "gemma3": ("gemma3", TAG_CASES, ""),
    "qwen3": ("qwen3", TAG_CASES, QWEN3_THINKING),
    "llama3": ("llama3", JSON_CASES, ""),
    "llama3.1": ("llama3_1", JSON_CASES, ""),
}


@pytest.fixture(scope="module")
def renderers(tokenizer):
    """One renderer per family, made on first use (a missing fixture skips only its family)."""
    made: dict[str, Renderer] = {}

    def get(family: str) -> Renderer:
        if family not in made:
            fixture = FAMILIES[family][0]
            made[family] = get_renderer(family, tokenizer if fixture == "smollm2" else load_for_test(fixture))
        return made[family]

    return get


def completion_ids(renderer: Renderer, text: str, ended: bool) -> list[int]:
    return renderer.encode_text(text) + ([renderer._special_ids[renderer.end_of_turn]] if ended else [])


def failures_of(parsed: ParsedCompletion, tools=TOOLS, cut: bool | None = None) -> dict[str, int]:
    return dict(turn_failures(parsed.message, parsed.errors, tools, cut))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_golden_reasons_per_family(renderers, family):
    renderer = renderers(family)
    _, cases, prefix = FAMILIES[family]
    for case, text, ended, expected in cases:
        parsed = renderer.parse_completion(completion_ids(renderer, prefix + text, ended))
        assert parsed.ended_with_eot == ended, case
        assert failures_of(parsed) == expected, (family, case, parsed.errors)
        # the episode loop's view: the reason settled again by the turn's finish reason agrees
        assert failures_of(parsed, cut=not ended) == expected, (family, case)
        for error in parsed.errors:
            assert isinstance(error, CallError), (family, case)
            # a trajectory read back from JSON keeps the text only: it gives the same reason
            assert error_reason(str(error), cut=not ended) == error.reason, (family, case, error)


def test_qwen3_calls_written_while_thinking_are_no_failures(renderers):
    renderer = renderers("qwen3")
    thinking = "<think>\n" + _tag('{"name": "add", "arguments": {"a": 1,}}') + "\n</think>\n\nNo call."
    assert failures_of(renderer.parse_completion(completion_ids(renderer, thinking, True))) == {}


def test_example_plugin_renderer(tokenizer):
    from tracegym.plugins import load_plugins

    (module,) = load_plugins([EXAMPLE_PLUGIN])
    renderer = module.BracketRenderer(tokenizer)
    cases = [('>>> add {"a": 1, "b": 2}', {}), ('>>> add {"a": 1,}', {"bad_json": 1}), (">>> add [1]", {"bad_args": 1}),
             ('>>> multiply {"a": 1}', {"unknown_tool": 1}), ('>>> add {"a": 1}', {"bad_args": 1})]
    for text, expected in cases:
        parsed = renderer.parse_completion(completion_ids(renderer, text, True))
        assert failures_of(parsed) == expected, (text, parsed.errors)
        assert all(isinstance(e, CallError) for e in parsed.errors)  # toolcalls.call_error gives reasons


class PlainStringRenderer(SmolLM2Renderer):
    """A plugin whose parser returns its own plain strings: one per marker letter in the text."""

    name = "plain_strings"
    TEXTS = {"A": "Unknown tool 'zap'.", "B": "Could not parse the JSON of your call.", "C": "The call was cut off.",
             "D": "Argument 'x' has the wrong type.", "E": "Something odd happened."}

    def _parse_assistant_text(self, value: str) -> tuple[Message, tuple[str, ...]]:
        return Message(role="assistant", content=value), tuple(self.TEXTS[c] for c in value if c in self.TEXTS)


def test_plugin_plain_strings_get_the_reason_their_text_names(tokenizer):
    renderer = PlainStringRenderer(tokenizer)
    ended = renderer.parse_completion(completion_ids(renderer, "ABCDE", True))
    assert [e.reason for e in ended.errors] == ["unknown_tool", "bad_json", "bad_json", "bad_args", "other"]
    cut = renderer.parse_completion(completion_ids(renderer, "C", False))
    assert [e.reason for e in cut.errors] == ["truncated"] and cut.errors == (PlainStringRenderer.TEXTS["C"],)
    # a plain string with no reason known at all (the episode loop, a message-level policy)
    assert [reason_from_text(t) for t in PlainStringRenderer.TEXTS.values()] == [
        "unknown_tool", "bad_json", "truncated", "bad_args", "other"]


def test_errors_that_are_no_call_are_other(renderers):
    renderer = renderers("hermes")
    parsed = renderer.parse_completion([-1, 10**9] + completion_ids(renderer, "Fine.", True))
    assert [e.reason for e in parsed.errors] == ["other"] and "outside the vocabulary" in parsed.errors[0]


def test_call_error_is_a_str_that_keeps_its_reason_through_copies():
    import copy
    import pickle

    error = CallError("Tool call 1: bad", "bad_json")
    assert error == "Tool call 1: bad" and json.dumps([error]) == '["Tool call 1: bad"]'
    parsed = ParsedCompletion(message=Message(role="assistant"), errors=(error, "plain"))
    assert parsed.errors[0].reason == "bad_json" and not isinstance(parsed.errors[1], CallError)
    assert pickle.loads(pickle.dumps(parsed)).errors[0].reason == "bad_json"
    assert copy.deepcopy(parsed).errors[0].reason == "bad_json"
    with pytest.raises(ValueError, match="reason must be one of"):
        CallError("x", "nonsense")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ParsedCompletion(message=Message(role="assistant"), errors=(3,))  # still only strings


def test_schema_check_needs_declared_tools_and_tolerates_odd_schemas():
    call = ToolCall(name="add", arguments={"a": 1})
    assert schema_failure(call, ()) is None  # no tools declared: nothing is judged
    assert schema_failure(call, ({"name": "add", "parameters": {}},)) is None  # bare format, empty schema
    assert schema_failure(call, ({"name": "add", "parameters": {"type": "object", "required": ["b"]}},)) == "bad_args"
    bad_schema = {"name": "add", "parameters": {"type": "no-such-type"}}
    assert schema_failure(call, (bad_schema,)) is None  # not a schema: the env decides
    unresolvable = {"name": "add", "parameters": {"$ref": "#/definitions/missing"}}
    assert schema_failure(call, (unresolvable,)) is None


# --- the episode loop -----------------------------------------------------------------------------


class Adder(ToolEnv):
    name = "adder"

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return [Task(id=f"{split}-{i}", split=split) for i in range(n)]

    async def reset(self, task: Task) -> list[Message]:
        return [Message(role="user", content="What is 1 + 2?")]

    def expert_action(self) -> Message:
        return Message(role="assistant", content="<answer>3</answer>")

    def score_answer(self, answer: str) -> float:
        return float(answer == "3")

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: First.
            b: Second.
        """
        return a + b


# each turn's completion text and whether sampling stopped on the stop token
SCRIPT = [
    (_tag('{"name": "add", "arguments": {"a": 1, "b": 2}}') + "\n" + _tag('{"name": "add", "arguments": {"a": 1,}}'), True),
    (_tag('{"name": "multiply", "arguments": {"a": 1, "b": 2}}'), True),
    (_tag('{"name": "add", "arguments": {"a": 1}}'), True),
    ("Adding. " + _tag('{"name": "add", "arguments": {"a": 1', close=False), False),
    ("<answer>3</answer>", True),
]


def scripted_policy(renderer: Renderer):
    async def policy(obs: Observation) -> Action:
        text, ended = SCRIPT[obs.turn]
        ids = completion_ids(renderer, text, ended)
        parsed = renderer.parse_completion(ids)
        tokens = TokenData(prompt_ids=(obs.turn,), completion_ids=ids, finish_reason="stop" if ended else "length")
        return Action(message=parsed.message, parse_errors=tuple(parsed.errors), tokens=tokens)

    return policy


@pytest.fixture(scope="module")
def episode(tokenizer) -> Trajectory:
    renderer = get_renderer("hermes", tokenizer)
    return asyncio.run(play_episode(Adder, Task(id="t0", split="test"), lambda env: scripted_policy(renderer),
                                    policy_name="scripted"))


def test_episode_counts_failures_by_reason_and_env_still_answers(episode):
    t = episode
    assert t.end_reason == "terminated" and t.success and len(t.turns) == 5
    assert {k: v for k, v in t.metrics.items() if k.startswith(FAILURE_METRIC_PREFIX)} == failure_metrics(
        {"bad_json": 1, "unknown_tool": 1, "bad_args": 1, "truncated": 1})
    # the env's own counters are unchanged: 2 parse errors (bad_json, truncated), 2 calls it refused
    assert (t.metrics["parse_errors"], t.metrics["tool_errors"], t.metrics["tool_calls"]) == (2.0, 2.0, 3.0)
    # every failed call still went back to the model as an error, the good one as its result
    answers = [[m.content for m in turn.env_messages] for turn in t.turns[:4]]
    assert answers[0][0].startswith("Error: Tool call 2: invalid JSON") and answers[0][1] == "3"
    assert answers[1][0].startswith("Error: unknown tool 'multiply'")
    assert answers[2][0].startswith("Error: invalid arguments for tool 'add': missing required argument 'b'")
    assert answers[3][0].startswith("Error: Tool call 1: <tool_call> is never closed")


def test_episode_without_tools_or_failures_has_no_failure_metrics():
    class NoTools(Adder):
        @classmethod
        def tool_functions(cls):
            return {}

    async def answer(obs: Observation) -> Action:
        return Action(message=Message(role="assistant", content="<answer>3</answer>"))

    t = asyncio.run(play_episode(NoTools, Task(id="t0"), lambda env: answer))
    assert t.success and not any(k.startswith(FAILURE_METRIC_PREFIX) for k in t.metrics)


# --- eval.json and the report ---------------------------------------------------------------------

EXPECTED = {"bad_json": 1, "unknown_tool": 1, "bad_args": 1, "truncated": 1, "other": 0}


def test_eval_json_sums_reasons_per_call_attempt(episode, tmp_path):
    # the scripted episode: 5 call attempts (2 in turn 0, one in each of turns 1-3), 4 failed
    summary = summarize([episode], ks=[1], turns=[5], n_bootstrap=10)
    failures = summary["call_failures"]
    assert failures["attempted_calls"] == 5 and failures["failed_calls"] == 4 and failures["failure_rate"] == 0.8
    assert failures["by_reason"] == {r: {"count": n, "rate": n / 5} for r, n in EXPECTED.items()}
    assert summary["metrics"][FAILURE_METRIC_PREFIX + "bad_json"] == 1.0  # and per episode, as every metric
    write_eval(tmp_path, summary, [episode], plots=False)
    assert load_eval(tmp_path)["call_failures"] == failures
    # read back from JSON (reasons are then only in the texts and the metrics), and as written
    # before the metrics existed: classified again from the turns, the same counts
    (again,) = [Trajectory.model_validate_json(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    old = again.model_copy(update={"metrics": {k: v for k, v in again.metrics.items()
                                               if not k.startswith(FAILURE_METRIC_PREFIX)}})
    for trajectory in (again, old):
        assert call_failure_stats([trajectory]).to_dict() == failures


def test_message_level_episodes_count_their_parse_errors_as_attempts():
    # no token turns: the parse errors live only in the metrics; each is a call attempt
    call = ToolCall(name="add", arguments={"a": 1, "b": 2}, id="call_0")
    t = Trajectory(env="adder", task_id="t", tools=(ADD_TOOL,), metrics=failure_metrics({"bad_json": 2}),
                   messages=(Message(role="user", content="q"), Message(role="assistant", tool_calls=(call,))))
    stats = call_failure_stats([t]).to_dict()
    assert stats["attempted_calls"] == 3 and stats["by_reason"]["bad_json"] == {"count": 2, "rate": 2 / 3}


def test_report_shows_the_failure_table(episode, tmp_path):
    summary = summarize([episode], ks=[1], turns=[5], n_bootstrap=10)
    write_eval(tmp_path / "rl", summary, [episode], plots=False)
    html = render_report(tmp_path)
    assert '<table class="call-failures">' in html
    for reason, n in EXPECTED.items():
        assert f"<tr><td>{reason}</td><td class=\"num\">{n}</td><td class=\"num\">{100 * n / 5:.1f}%</td>" in html
    assert '<tr><td>all</td><td class="num">4</td><td class="num">80.0%</td><td>of 5 call attempts</td></tr>' in html
    # the trajectory's own line
    assert "Failed tool calls: bad_json 1, unknown_tool 1, bad_args 1, truncated 1</div>" in html
    # an eval.json from before (no call_failures), or one without any call: no table
    assert call_failure_rows({}) == [] and call_failure_rows({"call_failures": {"attempted_calls": 0}}) == []
    assert set(CALL_FAILURE_REASONS) == set(EXPECTED)


# --- RL rows and team episodes ----------------------------------------------------------------------

def test_rl_rows_carry_the_step_reasons(episode):
    from tracegym.rl.collect import call_failure_metrics, rollout_metrics

    expected = {"calls/attempted": 5.0, "calls/failure_rate": 0.8, **failure_metrics(EXPECTED)}
    assert call_failure_metrics([episode]) == expected
    assert call_failure_metrics([episode, episode])["calls/failure_rate"] == 0.8
    group = TrajectoryGroup(env="adder", task_id="t0", trajectories=(episode,))
    row = rollout_metrics([group], [])
    assert {k: row[k] for k in expected} == expected
    plain = Trajectory(env="adder", task_id="t", messages=(Message(role="assistant", content="<answer>3</answer>"),))
    assert call_failure_metrics([plain]) == {}


def test_team_episodes_count_each_role_s_failures():
    from tracegym.envs import make
    from tracegym.envs.episode import message_policy
    from tracegym.envs.team import play_team_episode

    def policies(env):
        tried: set[str] = set()

        async def solver(obs: Observation) -> Action:
            if "solver" not in tried:  # the solver's first turn: a call to an undeclared tool and a broken one
                tried.add("solver")
                bad = Message(role="assistant", tool_calls=(ToolCall(name="multiply", arguments={"a": 1}, id="c0"),))
                return Action(message=bad, parse_errors=(CallError("Tool call 2: invalid JSON", "bad_json"),))
            return Action(message=env.expert_action("solver"))

        return {"planner": message_policy(lambda: env.expert_action("planner")), "solver": solver}

    env = make("calc_relay")
    task = env.tasks("test", 1)[0]
    trajectories = asyncio.run(play_team_episode(lambda: make("calc_relay"), task, policies))
    by_role = {t.policy: t for t in trajectories}
    assert by_role["solver"].end_reason == "terminated" and by_role["solver"].success  # the env answered and went on
    solver = {k: v for k, v in by_role["solver"].metrics.items() if k.startswith(FAILURE_METRIC_PREFIX)}
    assert solver == failure_metrics({"unknown_tool": 1, "bad_json": 1})
    assert not any(k.startswith(FAILURE_METRIC_PREFIX) for k in by_role["planner"].metrics)  # no tools, no failure
