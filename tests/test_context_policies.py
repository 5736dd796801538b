"""Context policies (``rollout.context``): ``window`` and ``observation_masking`` rewrite what a
long episode's prompt shows; the trajectory becomes segments, each trained on exactly the prompt
the model saw and the tokens it sampled, and the episode's advantages reach every segment."""

from __future__ import annotations

import pytest

from tracegym.config.shared import ContextConfig
from tracegym.rollout import RolloutConfig, run_rollouts_sync
from tracegym.rollout.context import apply_context, rewrites_history
from tracegym.types import Generation, Message, ToolCall

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "%d + 1"}}\n</tool_call>'


def _history(turns: int) -> list[Message]:
    messages = [Message(role="system", content="sys"), Message(role="user", content="task")]
    for i in range(turns):
        messages.append(Message(role="assistant", tool_calls=(ToolCall(name="calculate", arguments={"expression": f"{i} + 1"},
                                                                       id=f"c{i}"),)))
        messages.append(Message(role="tool", content=f"result {i}", tool_call_id=f"c{i}", name="calculate"))
    return messages


def test_window_and_masking_show_the_opening_and_the_last_turns():
    history = _history(4)
    window = apply_context(history, ContextConfig(policy="window", keep_turns=2))
    assert [m.content for m in window if m.role != "assistant"] == ["sys", "task", "result 2", "result 3"]
    assert [m.tool_calls[0].arguments["expression"] for m in window if m.role == "assistant"] == ["2 + 1", "3 + 1"]
    masked = apply_context(history, ContextConfig(policy="observation_masking", keep_turns=1, placeholder="[gone]"))
    assert len(masked) == len(history)
    assert [m.content for m in masked if m.role == "tool"] == ["[gone]", "[gone]", "[gone]", "result 3"]
    assert all(a.tool_calls == b.tool_calls for a, b in zip(masked, history))  # the model's own calls stay
    assert apply_context(history, ContextConfig()) == history
    assert not rewrites_history(_history(2), ContextConfig(policy="window", keep_turns=2))
    assert rewrites_history(_history(3), ContextConfig(policy="window", keep_turns=2))


class Counting:
    """A token engine that always calls the calculator (so episodes run to ``max_turns``)."""

    name = "scripted"
    returns_logprobs = True

    def __init__(self, renderer):
        self.renderer, self.turn = renderer, 0

    def generate(self, prompts, params):
        out = []
        for _ in prompts:
            ids = self.renderer.encode_text(CALL % self.turn) + [self.renderer.stop_token_ids[0]]
            self.turn += 1
            out.append([Generation(token_ids=tuple(ids), logprobs=tuple(-0.25 for _ in ids))])
        return out


@pytest.fixture(scope="module")
def renderer():
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer

    return get_renderer("tiny-random", load_tokenizer("tiny-random"))


def _episode(renderer, context: dict):
    from tracegym.envs import make

    env_factory = lambda: make("calculator", num_calls=1)  # noqa: E731
    task = env_factory().tasks("train", 1)[0]
    config = RolloutConfig(samples_per_task=1, max_turns=5, max_context=None, concurrency=1, context=context)
    result = run_rollouts_sync(env_factory, [task], Counting(renderer), renderer, config, progress=False)
    (trajectory,) = result.trajectories
    return trajectory


@pytest.mark.parametrize("policy", ["window", "observation_masking"])
def test_a_rewritten_history_becomes_token_exact_segments(renderer, policy):
    full = _episode(renderer, {})
    trajectory = _episode(renderer, {"policy": policy, "keep_turns": 2})
    assert len(trajectory.turns) == len(full.turns) == 5
    context = ContextConfig(policy=policy, keep_turns=2)
    messages = list(trajectory.messages)
    starts = [i for i, m in enumerate(messages) if m.role == "assistant"]
    for n, turn in enumerate(trajectory.turns):
        seen = messages[:starts[n]]  # the history before turn n
        if n <= 2:  # up to keep_turns earlier turns: the full prompt, extended token by token
            assert turn.prompt_ids == full.turns[n].prompt_ids
        else:  # rewritten: the policy's view rendered afresh, shorter than the full prompt
            assert list(turn.prompt_ids) == renderer.render_prompt(apply_context(seen, context), list(trajectory.tools))
            if policy == "window":  # (a calculator result is shorter than the masking placeholder)
                assert len(turn.prompt_ids) < len(full.turns[n].prompt_ids)
    text = renderer.tokenizer.decode(trajectory.turns[4].prompt_ids)
    if policy == "window":
        assert '"0 + 1"' not in text and '"1 + 1"' not in text and '"3 + 1"' in text
    else:
        assert '"0 + 1"' in text and "[earlier tool output omitted]" in text
    # segments: turns 0-2 extend each other; 3 and 4 each start a new one
    examples = renderer.build_examples(trajectory, advantage=[0.1, 0.2, 0.3, 0.4, 0.5])
    assert len(examples) == 3 and len(renderer.build_examples(full)) == 1
    for example, turns in zip(examples, [trajectory.turns[:3], trajectory.turns[3:4], trajectory.turns[4:]]):
        trained = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
        assert trained == [i for turn in turns for i in turn.completion_ids]  # exactly the sampled tokens
        assert list(example.input_ids[:len(turns[0].prompt_ids)]) == list(turns[0].prompt_ids)  # exactly what it saw
    assert sorted({a for a, m in zip(examples[2].advantages, examples[2].loss_mask) if m}) == [0.5]
    assert sorted({a for a, m in zip(examples[0].advantages, examples[0].loss_mask) if m}) == [0.1, 0.2, 0.3]


def test_the_context_flag_is_checked():
    from tracegym.commands._policy import UsageError, context_arg

    assert context_arg("full") == {"policy": "full"}
    assert context_arg("window:3") == {"policy": "window", "keep_turns": 3}
    assert context_arg("observation_masking") == {"policy": "observation_masking"}
    for bad in ("summary", "window:0", "window:x"):
        with pytest.raises(UsageError, match="--context"):
            context_arg(bad)
    with pytest.raises(ValueError, match="keep_turns"):
        RolloutConfig(context={"policy": "window", "keep_turns": 0})


# --- summarize: the model writes a summary turn (trained, never sent to the env) ---------------------

SUMMARY = "I computed 0 + 1 and 1 + 1 so far."
SUMMARIZE = {"policy": "summarize", "keep_turns": 1, "summarize_at": 120, "max_summary_tokens": 64}


class Summarizing(Counting):
    """Calls the calculator; answers a summary request (the prompt ends with it) with ``SUMMARY``."""

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            if ContextConfig().summary_request in self.renderer.tokenizer.decode(prompt[-80:]):
                ids = self.renderer.encode_text(SUMMARY) + [self.renderer.stop_token_ids[0]]
                out.append([Generation(token_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids))])
            else:
                out.extend(super().generate([prompt], params))
        return out


def test_summarize_shows_the_opening_the_latest_summary_and_the_turns_since():
    config = ContextConfig(policy="summarize", keep_turns=1)
    history = _history(3)
    assert apply_context(history, config) == history and not rewrites_history(history, config)
    request, summary = Message(role="user", content=config.summary_request), Message(role="assistant", content="S1")
    history = history + [request, summary] + _history(5)[8:]  # three turns, a summary, two more turns
    shown = apply_context(history, config)
    assert [m.content for m in shown if m.role != "assistant"] == [
        "sys", "task", f"{config.summary_header}\nS1", "result 2", "result 3", "result 4"]
    assert rewrites_history(history, config)
    # a second summary supersedes the first; the turn before it stays (keep_turns 1)
    history = history + [request, Message(role="assistant", content="S2")]
    shown = apply_context(history, config)
    assert [m.content for m in shown if m.role != "assistant"] == ["sys", "task", f"{config.summary_header}\nS2", "result 4"]
    # a summary is due past summarize_at, never twice without an env step in between
    from tracegym.rollout.context import needs_summary

    assert not needs_summary(history, 10_000, config)
    assert needs_summary(history + _history(6)[12:], 10_000, config)
    assert not needs_summary(history + _history(6)[12:], config.summarize_at, config)
    assert not needs_summary(_history(3), 10_000, ContextConfig(policy="window"))


def test_a_summary_turn_is_trained_and_the_prompts_after_it_are_exact(renderer):
    from tracegym.envs import make
    from tracegym.eval.metrics import assistant_turns

    env_factory = lambda: make("calculator", num_calls=1)  # noqa: E731
    task = env_factory().tasks("train", 1)[0]
    full = _episode(renderer, {})
    at = len(full.turns[2].prompt_ids) - 1  # the first summary comes before the third action
    config = RolloutConfig(samples_per_task=1, max_turns=5, max_context=None, concurrency=1,
                           context={**SUMMARIZE, "summarize_at": at})
    (trajectory,) = run_rollouts_sync(env_factory, [task], Summarizing(renderer), renderer, config,
                                      progress=False).trajectories
    kinds = [t.kind for t in trajectory.turns]
    assert kinds.count("action") == assistant_turns(trajectory) == 5  # the turn limit counts env steps only
    first = kinds.index("summary")
    assert first == 2 and kinds[3] == "action"  # never two summaries in a row
    assert trajectory.turns[:2] == full.turns[:2]  # the full history until then
    summary = trajectory.turns[first]
    assert summary.message.content == SUMMARY and summary.env_messages == () and summary.reward == 0.0
    assert summary.state_key.startswith("summary:")
    previous = trajectory.turns[first - 1]
    # the summary's prompt extends the previous turn token by token (same segment), ending with the request
    assert summary.prompt_ids[:len(previous.prompt_ids) + len(previous.completion_ids)] == \
        previous.prompt_ids + previous.completion_ids
    assert renderer.tokenizer.decode(summary.prompt_ids).rstrip().endswith(
        renderer.tokenizer.decode(renderer.render_prompt([Message(role="user", content=ContextConfig().summary_request)]))
        .rstrip()[-40:])
    # the next action's prompt is the policy's view rendered afresh: the summary replaces the old turns
    after = trajectory.turns[first + 1]
    messages = list(trajectory.messages)
    seen = messages[:[i for i, m in enumerate(messages) if m is after.message or m == after.message][0]]
    context = config.context
    assert list(after.prompt_ids) == renderer.render_prompt(apply_context(seen, context), list(trajectory.tools))
    text = renderer.tokenizer.decode(after.prompt_ids)
    assert SUMMARY in text and context.summary_request not in text and '"0 + 1"' not in text
    # segments: the summary trains with the turns before it; every trained token is a sampled one
    advantages = [0.1 * (k + 1) for k in range(len(trajectory.turns))]
    examples = renderer.build_examples(trajectory, advantage=advantages)
    trained = [t for e in examples for t, m in zip(e.input_ids, e.loss_mask) if m]
    assert trained == [i for turn in trajectory.turns for i in turn.completion_ids]
    holding = [e for e in examples if list(e.input_ids[:len(summary.prompt_ids)]) == list(summary.prompt_ids)]
    assert holding and advantages[first] in {a for a, m in zip(holding[-1].advantages, holding[-1].loss_mask) if m}


def test_the_expert_summarizes_its_calls_and_still_solves(renderer):
    from tracegym.envs import make

    env_factory = lambda: make("calculator", num_calls=3)  # noqa: E731
    tasks = env_factory().tasks("test", 4)
    config = RolloutConfig(samples_per_task=1, max_turns=6, max_context=None, concurrency=4,
                           context={**SUMMARIZE, "summarize_at": 200})
    result = run_rollouts_sync(env_factory, tasks, "expert", renderer, config, progress=False)
    assert result.stats.success_rate == 1.0
    summaries = [t for traj in result.trajectories for t in traj.turns if t.kind == "summary"]
    assert summaries and all(s.message.content.startswith("Calls so far:\n- calculate(") for s in summaries)


class ChatSummarizing:
    """A message-level engine (``chat``): records what it was shown; summarizes when asked."""

    name = "chat"

    def __init__(self):
        self.shown: list[list[Message]] = []

    def chat(self, messages, tools, params):
        self.shown.append(list(messages))
        if messages[-1].content == ContextConfig().summary_request:
            return Message(role="assistant", content=SUMMARY)
        turn = sum(1 for m in messages if m.role == "tool")
        return Message(role="assistant", tool_calls=(ToolCall(name="calculate", arguments={"expression": f"{turn} + 1"},
                                                              id=f"c{turn}"),))


def test_a_message_level_engine_summarizes_and_then_sees_its_summary(renderer):
    from tracegym.envs import make

    env_factory = lambda: make("calculator", num_calls=1)  # noqa: E731
    task = env_factory().tasks("train", 1)[0]
    engine = ChatSummarizing()
    config = RolloutConfig(samples_per_task=1, max_turns=4, max_context=None, concurrency=1,
                           context={**SUMMARIZE, "summarize_at": 1})  # due after every env step
    (trajectory,) = run_rollouts_sync(env_factory, [task], engine, renderer, config, progress=False).trajectories
    assert [t.kind for t in trajectory.turns] == ["action", "summary", "action", "summary", "action", "summary", "action"]
    header = ContextConfig().summary_header
    after = engine.shown[2]  # the action after the first summary: opening, summary, the kept turn
    assert [m.role for m in after] == ["system", "user", "user", "assistant", "tool"]
    assert after[2].content == f"{header}\n{SUMMARY}"
    assert all(m.content != ContextConfig().summary_request for m in after)


def test_malformed_summaries_and_branching_are_refused(renderer):
    import asyncio

    from tracegym.config import RLConfig
    from tracegym.envs import make
    from tracegym.envs.episode import Action, TokenData, play_episode
    from tracegym.rollout.runner import run_prefixed_episodes

    request = Message(role="user", content="summarize")

    def policy_of(actions):
        async def act(obs):
            return actions[min(obs.turn, len(actions) - 1)]
        return lambda env: act

    summary = Action(message=Message(role="assistant", content="s"), tokens=TokenData((1,), (2,), None, "stop"),
                     summary_request=request)
    task = make("calculator").tasks("train", 1)[0]
    twice = asyncio.run(play_episode(lambda: make("calculator"), task, policy_of([summary]), max_turns=3))
    assert twice.end_reason == "engine_error" and "two summaries" in twice.error
    wrong = Action(message=summary.message, tokens=summary.tokens,
                   summary_request=Message(role="assistant", content="x"))
    bad = asyncio.run(play_episode(lambda: make("calculator"), task, policy_of([wrong]), max_turns=3))
    assert bad.end_reason == "engine_error" and "user message" in bad.error
    with pytest.raises(ValueError, match="summarize"):
        asyncio.run(run_prefixed_episodes("calculator", [], Summarizing(renderer), renderer,
                                          RolloutConfig(context=SUMMARIZE)))
    with pytest.raises(ValueError, match="summarize"):
        RLConfig(model={"name": "tiny-random"}, env={"name": "calculator"},
                 rollout={"strategy": "tree", "context": SUMMARIZE})


def test_the_summarize_flag_is_checked():
    from tracegym.commands._policy import UsageError, context_arg

    assert context_arg("summarize") == {"policy": "summarize"}
    assert context_arg("summarize:1@900") == {"policy": "summarize", "keep_turns": 1, "summarize_at": 900}
    for bad in ("window@900", "summarize@", "summarize@0", "summarize:x@9"):
        with pytest.raises(UsageError, match="--context"):
            context_arg(bad)
