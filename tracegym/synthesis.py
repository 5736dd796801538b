"""Teacher synthesis: a teacher plays an env, its episodes are filtered and re-rendered for a student.

    result = synthesize("calculator", {}, tasks, "http://127.0.0.1:8000/v1", student_renderer,
                        samples_per_task=4, filters="success,pareto,dedupe", out="runs/synth",
                        teacher_model="gpt-4o-mini", api_key_env="TEACHER_API_KEY")
    result.trajectories       # SFT-ready: token ids from the student's template, masks on its tokens
    result.summary            # counts before/after each filter, success rate, teacher, student

The teacher is any policy the rollout runner drives (``tracegym.rollout.run_rollouts``): the env's
scripted ``"expert"``, an OpenAI-compatible endpoint (a URL: the message-level ``openai`` engine),
or a local model name/folder (the ``hf`` engine with the teacher's own renderer). Whatever token
ids the teacher was recorded with, the messages are the truth: :func:`retokenize` rebuilds every
turn's prompt and completion ids with the student's renderer exactly as the runner would have built
them had the student written those messages, so ``build_examples`` trains on the student's tokens of
the assistant messages and nothing else.

Filters are plain functions ``(trajectories, **options) -> trajectories`` kept in :data:`FILTERS`
(``register_filter`` adds one) and composed left to right; each run records how many it kept.
They see the re-rendered trajectories, so the token costs they compare are the student's tokens.

- ``success``: rejection sampling. Keeps successful episodes, or with ``min_reward=TAU`` those with
  reward >= TAU.
- ``pareto``: among each task's successful episodes keeps those no other success dominates on cost
  ``(tool calls, generated tokens)`` (another is <= on both and < on one; ties are all kept).
  Failed episodes pass through untouched: dropping them is ``success``'s job.
- ``recovery``: keeps successful episodes in which a tool answered with an error and the agent
  acted again afterwards (it recovered). ``prefer`` keeps everything instead and orders each task's
  episodes recovered first, then by fewer generated tokens; ``per_task=N`` then keeps the first N.
- ``dedupe``: drops an episode whose assistant messages (content and tool calls, call ids ignored)
  equal those of an earlier episode of the same task.

A tool error is a ``tool`` message whose content starts with ``"Error"``: ``ToolEnv`` (and the MCP
envs built on it) answer an unknown tool, invalid arguments, a tool that raised or timed out, and a
malformed call the renderer could not parse that way, and ``check_env`` reads errors the same way.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from tracegym.types import Message, Trajectory, Turn

log = logging.getLogger(__name__)

__all__ = [
    "FILTERS",
    "FilterCount",
    "FilterSpec",
    "SynthesisResult",
    "Teacher",
    "TeacherError",
    "apply_filters",
    "dedupe_filter",
    "generated_tokens",
    "is_recovery",
    "is_tool_error",
    "make_teacher",
    "pareto_filter",
    "parse_filters",
    "recovered_errors",
    "recovery_filter",
    "register_filter",
    "retokenize",
    "success_filter",
    "synthesize",
    "tool_call_count",
]

TOOL_ERROR_PREFIX = "Error"


# --- re-rendering for the student -------------------------------------------------------------------


def _steps_of(trajectory: Trajectory) -> tuple[list[Message], list[tuple[Message, tuple[Message, ...], Turn | None]]]:
    """``(initial messages, [(assistant message, the env's answer, recorded turn or None)])``.

    With recorded turns, the turns say which messages are assistant turns and which answered them;
    the initial messages are what comes before the first turn's message (an env may open with
    messages of any role). A message-only trajectory (``turns == ()``) is split at its assistant
    messages."""
    messages = list(trajectory.messages)
    if not trajectory.turns:
        first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
        steps: list[tuple[Message, tuple[Message, ...], Turn | None]] = []
        for message in messages[first:]:
            if message.role == "assistant":
                steps.append((message, (), None))
            else:
                assistant, answer, _ = steps[-1]
                steps[-1] = (assistant, answer + (message,), None)
        return messages[:first], steps

    def turns_start_at(start: int) -> bool:
        i = start
        for turn in trajectory.turns:
            if i >= len(messages) or messages[i] != turn.message:
                return False
            n = len(turn.env_messages)
            if tuple(messages[i + 1 : i + 1 + n]) != turn.env_messages:
                return False
            i += 1 + n
        return True  # anything after: an assistant message a timeout cut before its turn was recorded

    for start in range(len(messages)):
        if turns_start_at(start):
            return messages[:start], [(t.message, t.env_messages, t) for t in trajectory.turns]
    raise ValueError(
        f"{trajectory.env}/{trajectory.task_id}/{trajectory.sample_index}: its turns are not in its messages in order"
    )


def retokenize(trajectory: Trajectory, renderer: Any) -> Trajectory:
    """``trajectory`` with every turn's token ids rebuilt by ``renderer`` (the student's template).

    The prompts are built the way the rollout runner builds them: ``render_prompt(initial messages,
    tools)`` for the first turn, then ``continue_prompt(previous prompt, previous completion, the
    env's answer)``; each completion is ``encode_completion(assistant message)``. So
    ``renderer.build_examples`` on the result trains exactly on the student's tokens of the
    assistant messages (their end-of-turn token included). ``completion_logprobs`` becomes None: the
    student did not sample these tokens. Everything else is kept; a message-only trajectory gets one
    turn per assistant message, the episode reward on its last turn.
    """
    initial, steps = _steps_of(trajectory)
    tools = list(trajectory.tools) or None
    turns: list[Turn] = []
    prompt: list[int] | None = None
    completion: list[int] = []
    previous_answer: tuple[Message, ...] = ()
    for index, (message, answer, recorded) in enumerate(steps):
        if prompt is None:
            prompt = list(renderer.render_prompt(initial, tools))
        else:
            prompt = list(renderer.continue_prompt(prompt, completion, list(previous_answer)))
        completion = list(renderer.encode_completion(message))
        ids = {"prompt_ids": tuple(prompt), "completion_ids": tuple(completion), "completion_logprobs": None}
        if recorded is not None:
            turns.append(recorded.model_copy(update=ids))
        else:
            last = index == len(steps) - 1
            turns.append(Turn(message=message, env_messages=answer, reward=trajectory.reward if last else 0.0, **ids))
        previous_answer = answer
    return trajectory.model_copy(update={"turns": tuple(turns)})


# --- what the filters measure -------------------------------------------------------------------------


def is_tool_error(message: Message) -> bool:
    """A tool's answer that reports a failure (see the module doc)."""
    return message.role == "tool" and message.content.lstrip().startswith(TOOL_ERROR_PREFIX)


def tool_call_count(trajectory: Trajectory) -> int:
    """Tool calls the assistant made in the episode (well-formed ones: a malformed call is no call)."""
    return sum(len(m.tool_calls) for m in trajectory.messages if m.role == "assistant")


def generated_tokens(trajectory: Trajectory) -> int:
    """Completion tokens of the recorded turns (after :func:`retokenize`: the student's tokens)."""
    return trajectory.num_generated_tokens


def recovered_errors(trajectory: Trajectory) -> int:
    """Tool errors the agent acted on: error answers followed by a later assistant message. An error
    in the episode's last answer (e.g. calls after the one that ended it) was never recovered from."""
    count = pending = 0
    for message in trajectory.messages:
        if message.role == "assistant":
            count, pending = count + pending, 0
        elif is_tool_error(message):
            pending += 1
    return count


def is_recovery(trajectory: Trajectory) -> bool:
    """A successful episode that hit a tool error and went on after it."""
    return trajectory.success and recovered_errors(trajectory) > 0


def _task_key(trajectory: Trajectory) -> tuple[str, str]:
    return trajectory.env, trajectory.task_id


# --- filters ---------------------------------------------------------------------------------------


def success_filter(trajectories: Sequence[Trajectory], *, min_reward: float | None = None) -> list[Trajectory]:
    """Rejection sampling: the successful episodes, or those with ``reward >= min_reward`` when given."""
    if min_reward is not None:
        if isinstance(min_reward, bool) or not isinstance(min_reward, (int, float)):
            raise ValueError(f"success: min_reward must be a number, got {min_reward!r}")
        return [t for t in trajectories if t.reward >= min_reward]
    return [t for t in trajectories if t.success]


def _dominates(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """``a`` is no worse than ``b`` on every cost and better on one (lower is better)."""
    return all(x <= y for x, y in zip(a, b)) and a != b


def pareto_filter(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Each task's successes not dominated on ``(tool calls, generated tokens)``; failures untouched."""
    costs = {id(t): (tool_call_count(t), generated_tokens(t)) for t in trajectories if t.success}
    by_task: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for t in trajectories:
        if t.success:
            by_task.setdefault(_task_key(t), []).append(costs[id(t)])
    return [
        t for t in trajectories
        if not t.success or not any(_dominates(other, costs[id(t)]) for other in by_task[_task_key(t)])
    ]


def recovery_filter(
    trajectories: Sequence[Trajectory], *, prefer: bool = False, per_task: int | None = None
) -> list[Trajectory]:
    """The recovered episodes (:func:`is_recovery`); with ``prefer``, every episode, each task's
    ordered recovered first, then successful, then by fewer generated tokens, at most ``per_task``
    of them per task when given."""
    if per_task is not None and (isinstance(per_task, bool) or not isinstance(per_task, int) or per_task < 1):
        raise ValueError(f"recovery: per_task must be an integer >= 1, got {per_task!r}")
    if not isinstance(prefer, bool):
        raise ValueError(f"recovery: prefer must be true or false, got {prefer!r}")
    if not prefer:
        kept = [t for t in trajectories if is_recovery(t)]
        if per_task is None:
            return kept
        trajectories, prefer = kept, True  # the cap applies to the recovered ones, shortest first
    groups: dict[tuple[str, str], list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(_task_key(t), []).append(t)
    out: list[Trajectory] = []
    for group in groups.values():
        ranked = sorted(group, key=lambda t: (not is_recovery(t), not t.success, generated_tokens(t)))  # stable
        out.extend(ranked if per_task is None else ranked[:per_task])
    return out


def _assistant_signature(trajectory: Trajectory) -> tuple:
    """What the agent did, comparable across samples: call ids differ between samples (servers make
    them up), so they are left out, as is the raw call text (the parsed call is what ran)."""
    return tuple(
        (m.content, tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in m.tool_calls))
        for m in trajectory.messages if m.role == "assistant"
    )


def dedupe_filter(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Drops an episode whose assistant messages equal an earlier episode's of the same task."""
    seen: set[tuple] = set()
    out: list[Trajectory] = []
    for t in trajectories:
        key = (_task_key(t), _assistant_signature(t))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


FilterFn = Callable[..., list[Trajectory]]

FILTERS: dict[str, FilterFn] = {
    "success": success_filter,
    "pareto": pareto_filter,
    "recovery": recovery_filter,
    "dedupe": dedupe_filter,
}
"""Filter name -> ``fn(trajectories, **options) -> kept trajectories``. Options are keyword-only
parameters; a filter must accept an empty list (options are checked by calling it on one)."""


def register_filter(name: str, fn: FilterFn) -> None:
    """Make ``fn`` usable by name in ``filters`` / ``--filters``."""
    if not name or any(ch in name for ch in ",:= "):
        raise ValueError(f"a filter name cannot be empty or hold ',', ':', '=' or spaces: {name!r}")
    FILTERS[name] = fn


@dataclass(frozen=True)
class FilterSpec:
    """One filter of a chain: its name in :data:`FILTERS` and its options."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        opts = "".join(f":{k}" if v is True else f":{k}={json.dumps(v)}" for k, v in self.options.items())
        return f"{self.name}{opts}"


def _option_value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _parse_one(text: str) -> FilterSpec:
    """``name``, ``name:flag`` or ``name:key=value`` (several ``:``-separated options)."""
    name, *parts = [p.strip() for p in text.split(":")]
    options: dict[str, Any] = {}
    for part in parts:
        if not part:
            raise ValueError(f"filter {text!r}: empty option")
        key, eq, value = part.partition("=")
        options[key.strip()] = _option_value(value) if eq else True
    return FilterSpec(name, options)


def _check(spec: FilterSpec) -> FilterSpec:
    fn = FILTERS.get(spec.name)
    if fn is None:
        close = difflib.get_close_matches(spec.name, list(FILTERS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown filter {spec.name!r}{hint}; known filters: {', '.join(FILTERS)}")
    accepted = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = [k for k in spec.options if k not in accepted]
    if unknown:
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes none"
        raise ValueError(f"filter {spec.name!r} has no option {unknown[0]!r} ({takes})")
    try:  # bad option values fail here, before any teacher time is spent
        fn([], **spec.options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"filter {spec}: {exc}") from exc
    return spec


def parse_filters(filters: str | Iterable[str | FilterSpec] | None) -> list[FilterSpec]:
    """Filter specs from ``"success,pareto,recovery:prefer,dedupe"`` (options after ``:``, values
    parsed as YAML: ``success:min_reward=0.5``, ``recovery:prefer:per_task=2``), a list of such
    strings, or ``FilterSpec``s. ValueError for an unknown filter, option or value. ``None``, ``""``
    and ``"none"`` mean no filter."""
    if filters is None:
        return []
    if isinstance(filters, str):
        items: list[str | FilterSpec] = [p for p in (s.strip() for s in filters.split(",")) if p]
        if items == ["none"]:
            return []
    else:
        items = list(filters)
    return [_check(item if isinstance(item, FilterSpec) else _parse_one(item)) for item in items]


@dataclass
class FilterCount:
    """How many trajectories one filter of the chain saw and kept."""

    filter: str
    before: int
    after: int


def apply_filters(
    trajectories: Sequence[Trajectory], filters: str | Iterable[str | FilterSpec] | None
) -> tuple[list[Trajectory], list[FilterCount]]:
    """Run the filters left to right; returns the survivors and each filter's counts (also logged)."""
    kept = list(trajectories)
    counts: list[FilterCount] = []
    for spec in parse_filters(filters):
        before = len(kept)
        kept = list(FILTERS[spec.name](kept, **spec.options))
        counts.append(FilterCount(str(spec), before, len(kept)))
        log.info("filter %s: kept %d of %d", spec, len(kept), before)
    return kept, counts


# --- the teacher ------------------------------------------------------------------------------------


class TeacherError(ValueError):
    """A teacher spec that names nothing runnable, or options that do not fit it."""


@dataclass
class Teacher:
    """A policy for ``run_rollouts`` and what to record about it (never a secret)."""

    policy: Any
    """``"expert"`` or an engine."""
    name: str
    """Recorded in ``Trajectory.policy``."""
    renderer: Any | None = None
    """The renderer the teacher's turns are recorded with (its own template for a local model);
    None: the student's (the expert and endpoints record messages; their ids are re-rendered anyway)."""
    description: dict[str, Any] = field(default_factory=dict)
    owned: bool = False
    """Built here, so closed here."""

    def describe(self) -> dict[str, Any]:
        usage = getattr(self.policy, "usage", None)
        out = dict(self.description)
        if isinstance(usage, dict):
            out["usage"] = dict(usage)  # tokens the endpoint billed (openai engine)
        return out

    def close(self) -> None:
        close = getattr(self.policy, "close", None)
        if self.owned and callable(close):
            close()


def is_endpoint(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def make_teacher(
    spec: str,
    *,
    model: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    renderer: str | None = None,
    max_batch_size: int = 64,
) -> Teacher:
    """The teacher ``spec`` names: ``"expert"``; a URL of an OpenAI-compatible server (``model``: the
    model id to ask for, default the server's only model; the key is read from the environment
    variable ``api_key_env``); or a local model name/folder run by the hf engine with its own
    renderer (``renderer`` overrides it). TeacherError when ``spec`` and the options do not fit;
    ``UnknownModelError`` for a local model that does not exist."""
    from tracegym.engines import make_engine

    if spec == "expert" or not is_endpoint(spec):
        if model is not None:
            raise TeacherError("a teacher model id is only for an endpoint teacher (--teacher http://.../v1)")
    if spec == "expert":
        if renderer is not None:
            raise TeacherError("the expert teacher has no renderer of its own "
                               "(its messages are rendered for the student)")
        return Teacher("expert", "expert", None, {"kind": "expert"})
    if is_endpoint(spec):
        if renderer is not None:
            raise TeacherError("an endpoint teacher renders on its server; "
                               "a teacher renderer is only for a local model")
        if model is None:
            probe = make_engine("openai", model="", base_url=spec, api_key_env=api_key_env)
            try:
                served = probe.models()
            finally:
                probe.close()
            if len(served) != 1:
                raise TeacherError(f"{spec} serves {len(served)} models ({', '.join(served[:5])}); "
                                   "name one with --teacher-model")
            model = served[0]
        engine = make_engine("openai", model=model, base_url=spec, api_key_env=api_key_env)
        description = {"kind": "openai", "base_url": engine.base_url, "model": model, "api_key_env": api_key_env}
        return Teacher(engine, model, None, description, owned=True)
    from tracegym.models import load
    from tracegym.render import get_renderer

    loaded, tokenizer = load(spec)
    try:
        teacher_renderer = get_renderer(renderer or spec, tokenizer)
    except ValueError as exc:
        raise TeacherError(str(exc)) from exc
    engine = make_engine("hf", model=loaded, tokenizer=tokenizer, renderer=teacher_renderer,
                         max_batch_size=max_batch_size)
    description = {"kind": "hf", "model": spec, "renderer": teacher_renderer.name}
    return Teacher(engine, spec, teacher_renderer, description, owned=True)


# --- synthesis --------------------------------------------------------------------------------------


@dataclass
class SynthesisResult:
    trajectories: list[Trajectory]
    """Survivors of the filters, re-rendered for the student."""
    teacher_trajectories: list[Trajectory]
    """Every episode the runner kept, as the teacher recorded it (before filters)."""
    summary: dict[str, Any]


def synthesize(
    env: Any,
    env_options: dict[str, Any] | None,
    tasks: Sequence[Any],
    teacher: str | Teacher,
    student_renderer: Any,
    samples_per_task: int,
    filters: str | Iterable[str | FilterSpec] | None,
    out: str | Path | None = None,
    *,
    config: Any | None = None,
    student: str | None = None,
    teacher_model: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    teacher_renderer: str | None = None,
    parquet: bool = False,
    progress: bool = False,
) -> SynthesisResult:
    """Run ``teacher`` on ``tasks`` (``samples_per_task`` each) in ``env`` (a name with
    ``env_options``, or a factory), re-render its episodes for ``student_renderer``, apply
    ``filters`` and, when ``out`` is given, write there:

    - ``trajectories.jsonl``: the survivors, SFT-ready (``tracegym sft`` with ``data.train_files``);
    - ``teacher.jsonl``: every episode the teacher finished, as recorded, before the filters;
    - ``summary.json``: teacher, student template, success rate, counts before/after each filter;
    - ``trajectories.parquet`` with ``parquet``.

    ``teacher``: a spec for :func:`make_teacher` (with ``teacher_model``, ``api_key_env`` and
    ``teacher_renderer``) or a ready :class:`Teacher`. ``config``: a ``RolloutConfig`` (turn and
    token limits, temperature, seed, concurrency); its ``samples_per_task`` is replaced.
    ``student``: the student model's name, recorded so ``tracegym inspect`` picks its tokenizer.
    """
    from tracegym.rollout import RolloutConfig, run_rollouts

    if samples_per_task < 1:
        raise ValueError(f"samples_per_task must be >= 1, got {samples_per_task}")
    specs = parse_filters(filters)  # a bad filter fails before the teacher runs
    cfg = (config or RolloutConfig()).model_copy(update={"samples_per_task": samples_per_task})
    built = not isinstance(teacher, Teacher)
    if built:
        teacher = make_teacher(teacher, model=teacher_model, api_key_env=api_key_env, renderer=teacher_renderer,
                               max_batch_size=cfg.concurrency)
    assert isinstance(teacher, Teacher)
    try:
        result = asyncio.run(run_rollouts(
            env, tasks, teacher.policy, teacher.renderer or student_renderer, cfg, progress=progress,
            env_options=env_options, policy_name=teacher.name,
        ))
    finally:
        if built:
            teacher.close()
    tag = {"teacher": teacher.name, "renderer": getattr(student_renderer, "name", None)}
    if student is not None:
        tag["tokenizer"] = student  # read by tracegym inspect
    rendered: list[Trajectory] = []
    render_errors: list[str] = []
    for t in result.trajectories:
        try:
            rendered.append(retokenize(t, student_renderer).model_copy(update={"info": {**t.info, **tag}}))
        except Exception as exc:  # noqa: BLE001 - one odd episode must not waste the teacher's run
            render_errors.append(f"{t.task_id}/{t.sample_index}: {type(exc).__name__}: {exc}")
            log.warning("cannot re-render %s/%d for the student: %s", t.task_id, t.sample_index, exc)
    kept, counts = apply_filters(rendered, specs)

    stats = result.stats
    summary: dict[str, Any] = {
        "env": env if isinstance(env, str) else getattr(env, "name", type(env).__name__),
        "env_options": dict(env_options or {}),
        "tasks": len(tasks),
        "samples_per_task": samples_per_task,
        "teacher": teacher.describe(),
        "student": {"model": student, "renderer": getattr(student_renderer, "name", type(student_renderer).__name__)},
        "episodes": stats.episodes,
        "teacher_failed": stats.failed,
        "success_rate": stats.success_rate,
        "mean_reward": stats.mean_reward,
        "end_reasons": stats.end_reasons,
        "errors": stats.errors[:10],
        "rendered": len(rendered),
        "render_errors": render_errors[:10],
        "filters": [vars(c) for c in counts],
        "kept": len(kept),
        "kept_tasks": len({_task_key(t) for t in kept}),
        "kept_successes": sum(t.success for t in kept),
        "generated_tokens": sum(generated_tokens(t) for t in kept),
        "wall_time_s": stats.wall_time_s,
        "config": cfg.model_dump(),
    }
    if out is not None:
        _write(Path(out), kept, result.trajectories, summary, parquet)
    return SynthesisResult(trajectories=kept, teacher_trajectories=list(result.trajectories), summary=summary)


def _write(
    out: Path, kept: list[Trajectory], recorded: list[Trajectory], summary: dict[str, Any], parquet: bool
) -> None:
    from tracegym.data.store import TrajectoryWriter

    out.mkdir(parents=True, exist_ok=True)
    with TrajectoryWriter(out / "trajectories.jsonl") as writer:
        writer.write_all(kept)
    with TrajectoryWriter(out / "teacher.jsonl") as writer:
        writer.write_all(recorded)
    if parquet:
        from tracegym.data.parquet import write_trajectories_parquet

        write_trajectories_parquet(kept, out / "trajectories.parquet")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
