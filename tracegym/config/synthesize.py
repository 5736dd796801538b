"""The config of ``tracegym synthesize --config``: teacher synthesis of SFT data."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from tracegym.config._base import _Section
from tracegym.config.shared import EnvConfig


class SynthesisTeacherConfig(_Section):
    source: str = "expert"
    """Who plays the env: ``expert`` (the env's scripted expert), a local model name or folder (hf
    engine; an adapter folder is merged onto its base), or the URL of an OpenAI-compatible server
    (``http://host:port/v1``)."""

    model: str | None = None
    """Server teacher: the model id to ask for (default: the server's only model)."""

    renderer: str | None = None
    """Local teacher: its chat-template renderer (default: the model's)."""

    api_key_env: str = Field("OPENAI_API_KEY", min_length=1)
    """Server teacher: the environment variable holding the API key (the key is never printed or written)."""


class SynthesisStudentConfig(_Section):
    model: str = "smollm2-135m"
    """The student whose tokenizer and chat template the data is re-rendered for."""

    renderer: str | None = None
    """The student's chat-template renderer (default: the model's)."""


class SynthesizeConfig(_Section):
    """Teacher synthesis (``tracegym synthesize --config``): a teacher plays an env, its episodes go
    through a chain of filters and are re-rendered with the student's template and masks."""

    plugins: list[str] = Field(default_factory=list)
    """Python modules imported before this config is validated (a module name, or a ``.py`` path
    relative to the config file): they register envs and filters (``--plugin`` adds more)."""

    env: EnvConfig = Field(default_factory=EnvConfig)
    """The environment the teacher plays (``env.injection`` is not used here)."""

    split: Literal["train", "test"] = "train"
    """Task split the tasks come from."""

    tasks: int = Field(8, gt=0)
    """Number of tasks."""

    task_seed: int = 0
    """Seed of the task draw (the same seed gives the same tasks)."""

    samples: int = Field(4, gt=0)
    """Teacher episodes per task."""

    teacher: SynthesisTeacherConfig = Field(default_factory=SynthesisTeacherConfig)
    """The teacher."""

    student: SynthesisStudentConfig = Field(default_factory=SynthesisStudentConfig)
    """The student the data is for."""

    filters: list[Any] = Field(default_factory=lambda: ["success", "dedupe"])
    """Filters applied in order (docs/synthesis.md). Each item is a name (``pareto``), a name with
    options (``{recovery: {prefer: true, per_task: 2}}``) or the CLI's form
    (``success:min_reward=0.5``); ``[]`` keeps every episode. Built in: ``success`` (rejection
    sampling; option ``min_reward``), ``pareto`` (each task's successes not dominated on tool calls
    and generated tokens), ``recovery`` (episodes that hit a tool error and recovered; options
    ``prefer``, ``per_task``), ``dedupe``; ``tracegym.data.filters.register_filter`` adds more."""

    max_turns: int | None = Field(None, gt=0)
    """Assistant turns per episode (default: the env's limit)."""

    max_tokens_per_turn: int = Field(512, gt=0)
    """Teacher tokens per turn."""

    max_context: int | None = Field(None, gt=0)
    """End an episode whose next prompt, in student tokens, exceeds this (default: no limit)."""

    temperature: float = Field(1.0, ge=0)
    """Teacher sampling temperature."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Teacher nucleus sampling."""

    seed: int = 0
    """Sampling seed."""

    timeout: float | None = Field(None, gt=0)
    """Wall-clock limit per episode, in seconds."""

    concurrency: int = Field(16, gt=0)
    """Episodes alive at once."""

    parquet: bool = False
    """Also write ``trajectories.parquet``."""

    output_dir: str = "runs/synth"
    """Where ``trajectories.jsonl`` (SFT-ready), ``teacher.jsonl``, ``summary.json`` and the
    resolved ``config.yaml`` go."""

    @field_validator("filters", mode="before")
    @classmethod
    def _filters(cls, value: Any) -> Any:
        """Each item as the CLI's text form, checked against the registered filters (unknown names
        and options, bad values): ``{recovery: {prefer: true}}`` -> ``"recovery:prefer=true"``."""
        from tracegym.data.filters import parse_filters

        if value is None:
            return []
        if isinstance(value, str):
            value = [value] if value.strip() else []
        if not isinstance(value, list):
            raise ValueError(f"expected a list of filters, got {type(value).__name__}")
        items = []
        for item in value:
            if isinstance(item, dict):
                if len(item) != 1:
                    raise ValueError(f"a filter with options is one mapping {{name: {{option: value}}}}, got {item!r}")
                ((name, options),) = item.items()
                options = {} if options is None else options
                if not isinstance(options, dict):
                    raise ValueError(f"filter {name!r}: options must be a mapping, got {options!r}")
                item = name + "".join(f":{k}={json.dumps(v)}" for k, v in options.items())
            elif not isinstance(item, str):
                raise ValueError(f"a filter is a name or {{name: {{option: value}}}}, got {item!r}")
            items.append(item)
        if items == ["none"]:
            return []
        return [str(spec) for spec in parse_filters(items)]
