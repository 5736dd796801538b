"""The contract every part of tracegym speaks.

Everything that crosses a module boundary is one of these types: environments take and return
``Message``s, engines take prompt token ids and return ``Generation``s, the rollout runner writes
``Trajectory``s, and the renderer turns a ``Trajectory`` into ``TrainingExample``s for SFT and RL.

All types are pydantic models, so they validate on construction and serialise to JSON
(``model_dump_json`` / ``model_validate_json``). This module imports nothing from the package.

Token-in, token-out: a ``Turn`` keeps the exact prompt token ids the engine saw and the exact
token ids it sampled, with their log-probs. Training never decodes and re-encodes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, WrapValidator

Role = Literal["system", "user", "assistant", "tool"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolCall(_Frozen):
    """One call of a tool by the model.

    ``arguments`` is the parsed JSON object; ``raw`` is the text the model wrote for the call
    (between ``<tool_call>`` tags in the Hermes convention), kept for inspection and debugging.
    ``id`` pairs the call with the ``tool`` message that answers it.
    """

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    raw: str = ""
    id: str | None = None


class Message(_Frozen):
    """One chat message.

    - ``system``/``user``: ``content`` only.
    - ``assistant``: ``content`` (text outside tool calls, stripped) and zero or more ``tool_calls``.
    - ``tool``: ``content`` is the tool's result (or an error text the model should see);
      ``tool_call_id`` names the call it answers and ``name`` the tool.
    """

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


CallFailureReason = Literal["bad_json", "unknown_tool", "bad_args", "truncated", "other"]
"""Why a tool-call attempt failed (``tracegym.render.call_errors`` says how each is found)."""

CALL_FAILURE_REASONS: tuple[CallFailureReason, ...] = ("bad_json", "unknown_tool", "bad_args", "truncated", "other")


class CallError(str):
    """The error text of a failed tool call that also carries its ``reason``.

    It is a ``str``: everything that shows, compares, stores or sends error texts takes it unchanged
    (``CallError("x", "bad_json") == "x"``). The reason lives only in memory: written to JSON it is the
    plain text, which ``tracegym.render.call_errors.error_reason`` classifies again."""

    reason: CallFailureReason

    def __new__(cls, text: str, reason: CallFailureReason) -> CallError:
        if reason not in CALL_FAILURE_REASONS:
            raise ValueError(f"reason must be one of {', '.join(CALL_FAILURE_REASONS)}, got {reason!r}")
        error = super().__new__(cls, text)
        error.reason = reason
        return error

    def __reduce__(self) -> tuple[Any, tuple[str, CallFailureReason]]:  # pickle, deepcopy: keep the reason
        return (CallError, (str(self), self.reason))


def _keep_str(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A ``str`` (a :class:`CallError` included) as it is; anything else through pydantic's ``str``."""
    return value if isinstance(value, str) else handler(value)


ErrorText = Annotated[str, WrapValidator(_keep_str)]
"""A ``str`` field that keeps a :class:`CallError` (pydantic would copy it into a plain ``str``)."""


class ParsedCompletion(_Frozen):
    """What the renderer makes of a sampled completion.

    ``message`` is always an assistant message. A malformed tool call (bad JSON, wrong shape) is not
    an exception: it lands in ``errors`` as a human-readable text that an environment shows to the
    model, and the call is left out of ``message.tool_calls``. The renderers give each error as a
    :class:`CallError`, whose ``reason`` says why the call failed.
    """

    message: Message
    errors: tuple[ErrorText, ...] = ()
    ended_with_eot: bool = True  # the completion ended with the end-of-turn token


class SamplingParams(_Frozen):
    """Sampling parameters for one generate call (same meaning as in vLLM and the OpenAI API)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None


FinishReason = Literal["stop", "length", "abort"]


class Generation(_Frozen):
    """One sampled completion: token ids, the log-prob of each under the sampling distribution."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None  # None for text-level engines (openai)
    finish_reason: FinishReason = "stop"
    text: str | None = None  # set by text-level engines; token engines may leave it None


BASE_ADAPTER = "__base__"
"""The adapter name that means "the base model, no LoRA" in a mixed-adapter batch (peft's name for it),
for every engine whose ``generate`` takes ``adapters=``."""

REWARD_PART_PREFIX = "reward/"
"""Info and metrics keys ``reward/<part>`` carry named reward parts (see :class:`StepResult`)."""


def reward_parts_in(values: dict[str, Any]) -> dict[str, float]:
    """``{part: value}`` of the numeric ``reward/<part>`` entries of an info or metrics dict."""
    return {
        key[len(REWARD_PART_PREFIX):]: float(value)
        for key, value in values.items()
        if key.startswith(REWARD_PART_PREFIX) and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class StepResult(_Frozen):
    """What an environment returns after one assistant message.

    ``terminated``: the task ended (solved, failed for good, or the agent gave its final answer).
    ``truncated``: a limit cut the episode before it ended (turns, budget). They never mean the same.
    ``reward`` is the reward for this step; the episode reward is the sum over steps.

    Reward parts (a rubric, ``tracegym.envs.rewards``): an env that splits its reward into named
    parts reports the unweighted value of each part for this step as ``info["reward/<part>"]``, and
    ``reward`` is their weighted sum. They ride in ``info`` (not a field of their own) so that every
    wrapper and replay that passes ``info`` on keeps them; the episode loop sums them per episode
    into ``Trajectory.metrics["reward/<part>"]``.
    """

    messages: tuple[Message, ...] = ()
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)
    """Numbers (metrics of the step), reward parts (``reward/<part>``), and ``artifacts``: a
    ``{name: file path}`` of files written for this step, kept in ``Turn.artifacts``."""

    @property
    def reward_parts(self) -> dict[str, float]:
        """``{part: unweighted value}`` of this step ({} for an env without parts)."""
        return reward_parts_in(self.info)


class Turn(_Frozen):
    """One assistant turn as the engine saw and produced it.

    ``prompt_ids``: the full prompt (whole conversation so far plus the generation prompt).
    ``completion_ids``: the sampled tokens, end-of-turn token included when it was sampled.
    ``completion_logprobs``: one per completion token under the sampling distribution, or None when
    the turn came from a text-level engine or a scripted expert.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    completion_logprobs: tuple[float, ...] | None = None
    finish_reason: FinishReason = "stop"
    message: Message  # the parsed assistant message
    parse_errors: tuple[str, ...] = ()
    env_messages: tuple[Message, ...] = ()  # what the env answered (tool results, user turns)
    reward: float = 0.0
    metrics: dict[str, float] = Field(default_factory=dict)
    artifacts: dict[str, str] = Field(default_factory=dict)
    """Files the env wrote for this step, by name (``StepResult.info["artifacts"]``): e.g. the web
    env's ``screenshot`` of the page after the action, which the HTML report shows with the turn."""
    kind: Literal["action", "summary"] = "action"
    """``action``: a turn the env was stepped with. ``summary``: a summary the model wrote of its own
    history (``rollout.context: summarize``); never sent to the env, reward 0, trained like any other
    turn; evaluation's turn counts leave it out."""
    state_key: str | None = None
    """Key of the environment state this turn acted in (``Env.state_key()`` before the action, or a
    hash of the observations so far): turns of one task with equal keys faced the same state, which
    step-level estimators (GiGPO) group on. None when unknown (old files, message-only episodes)."""


EndReason = Literal[
    "terminated",  # the env ended the task
    "truncated",  # the env cut it (its own limit)
    "max_turns",  # the runner's turn limit T
    "max_tokens",  # the runner's per-episode token budget
    "context",  # the next prompt would not fit the context window
    "timeout",  # wall-clock limit of the episode
    "env_error",  # the env raised; see ``error``
    "engine_error",  # the engine failed for this episode
]


class Trajectory(_Frozen):
    """One episode: the conversation, every assistant turn token-exact, rewards, and why it ended."""

    env: str
    task_id: str
    split: str = "train"
    sample_index: int = 0  # which of the K samples of this task
    tools: tuple[dict[str, Any], ...] = ()  # JSON schemas (OpenAI function format) shown to the model
    messages: tuple[Message, ...]  # the whole conversation, initial prompt included
    turns: tuple[Turn, ...] = ()
    reward: float = 0.0  # episode reward (sum of step rewards)
    success: bool = False
    metrics: dict[str, float] = Field(default_factory=dict)  # final step's numeric info; reward/<part> summed
    end_reason: EndReason = "terminated"
    error: str | None = None
    policy: str = ""  # model name, "expert", ...
    info: dict[str, Any] = Field(default_factory=dict)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def reward_parts(self) -> dict[str, float]:
        """``{part: unweighted sum over the episode}`` from ``metrics["reward/<part>"]`` ({} when the
        env reported no parts)."""
        return reward_parts_in(self.metrics)


class TrajectoryGroup(_Frozen):
    """The samples of one task under one policy: what group-relative estimators compare.

    ``trajectories`` are the kept episodes of ``task_id`` (failed ones excluded or zero-rewarded, as
    the rollout config says). Per-turn rewards are ``Turn.reward`` (the env's reward of that step; an
    outcome reward lands on the last turn), per-turn state keys ``Turn.state_key``. The episode reward
    ``Trajectory.reward`` is the sum of its turns' rewards.
    """

    env: str
    task_id: str
    trajectories: tuple[Trajectory, ...]

    @property
    def rewards(self) -> list[float]:
        """Episode reward of each trajectory."""
        return [t.reward for t in self.trajectories]

    @property
    def turn_rewards(self) -> list[list[float]]:
        """``[trajectory][turn]`` rewards."""
        return [[turn.reward for turn in t.turns] for t in self.trajectories]

    @property
    def state_keys(self) -> list[list[str | None]]:
        """``[trajectory][turn]`` env-state keys (None where unknown)."""
        return [[turn.state_key for turn in t.turns] for t in self.trajectories]

    @property
    def num_turns(self) -> list[int]:
        """Assistant turns of each trajectory."""
        return [len(t.turns) for t in self.trajectories]

    def __len__(self) -> int:
        return len(self.trajectories)


def group_trajectories(trajectories: Iterable[Trajectory]) -> list[TrajectoryGroup]:
    """Trajectories -> one group per (env, task id), in order of first appearance; within a group in
    the order given (the rollout runner returns them sorted by task, then sample index)."""
    groups: dict[tuple[str, str], list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault((t.env, t.task_id), []).append(t)
    return [TrajectoryGroup(env=env, task_id=task, trajectories=tuple(ts)) for (env, task), ts in groups.items()]


class TrainingExample(_Frozen):
    """One token sequence with explicit masks, for SFT and RL alike.

    All lists have the sequence length L. ``loss_mask[i] == 1`` exactly on tokens the model generated
    (its end-of-turn token included); 0 on system, user and tool tokens and on the generation prompt.
    ``weights`` are per-token SFT weights, ``advantages`` per-token RL advantages, ``logprobs`` the
    engine's sampled log-probs (0.0 where not generated or unknown). Token ``i`` is predicted from
    tokens ``< i``.
    """

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    weights: tuple[float, ...]
    advantages: tuple[float, ...]
    logprobs: tuple[float, ...]
    has_logprobs: bool = False
    source: str = ""  # "<env>/<task_id>/<sample_index>#<part>"

    def __len__(self) -> int:
        return len(self.input_ids)


# --- JSONL helpers --------------------------------------------------------------------------


def write_jsonl(path: str | Path, items: Iterable[BaseModel], append: bool = False) -> int:
    """Write models as JSON lines; returns how many were written. Each line is flushed."""
    n = 0
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for item in items:
            f.write(item.model_dump_json() + "\n")
            f.flush()
            n += 1
    return n


def read_json_rows_numbered(
    path: str | Path, limit: int | None = None
) -> tuple[list[tuple[int, dict[str, Any]]], list[tuple[int, str]]]:
    """The JSON-object lines of a JSONL file as (line number, object), and the unreadable lines as
    (line number, reason). Line numbers start at 1 and count blank lines, as an editor shows them.

    Unreadable: a torn line (a crash mid-write, invalid UTF-8 included), invalid JSON, or JSON that
    is not an object. ``limit`` stops after that many objects.
    """
    rows: list[tuple[int, dict[str, Any]]] = []
    problems: list[tuple[int, str]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                torn = "" if line.endswith("}") else " (torn line?)"
                problems.append((number, f"not valid JSON{torn}: {exc.msg} at column {exc.colno}"))
                continue
            if isinstance(row, dict):
                rows.append((number, row))
            else:
                problems.append((number, f"not a JSON object but {type(row).__name__}"))
            if limit is not None and len(rows) >= limit:
                break
    return rows, problems


def read_json_rows(path: str | Path, limit: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """The JSON-object lines of a JSONL file, and how many lines were unreadable.

    A torn line (a crash mid-write) or a line that is not a JSON object is counted and skipped, never
    fatal: every reader of tracegym's JSONL files (trajectories, examples, metrics) goes through here.
    :func:`read_json_rows_numbered` says which lines and why.
    """
    rows, problems = read_json_rows_numbered(path, limit)
    return [row for _, row in rows], len(problems)


def read_jsonl(path: str | Path, cls: type[BaseModel]) -> Iterator[Any]:
    """Read JSON lines into ``cls``; a torn last line (crash mid-write) is skipped, not fatal."""
    for row in read_json_rows(path)[0]:
        yield cls.model_validate(row)
