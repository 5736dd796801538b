"""Teacher synthesis (the recipe behind ``tracegym synthesize``): a teacher plays an env, its episodes are filtered and re-rendered for a student.

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

The filters (``success``, ``pareto``, ``recovery``, ``dedupe`` and any registered) live in
``tracegym.data.filters``; they see the re-rendered trajectories, so the token costs they compare
are the student's tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from tracegym.data.filters import FilterSpec, apply_filters, generated_tokens, parse_filters, task_key
from tracegym.types import Message, Trajectory, Turn

log = logging.getLogger(__name__)

__all__ = [
    "SynthesisResult",
    "Teacher",
    "TeacherError",
    "make_teacher",
    "retokenize",
    "synthesize",
]


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
        "kept_tasks": len({task_key(t) for t in kept}),
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
