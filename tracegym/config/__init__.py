"""Run configuration: one YAML file per run, validated into typed pydantic models.

A run is described by one file (``examples/sft_calculator.yaml``) plus optional command-line
overrides ``key.sub=value`` whose values are parsed as YAML (``lora.r=8``, ``optim.lr=1e-4``,
``data.train_files=[a.jsonl,b.jsonl]``). Every field carries a docstring that doubles as its
description (``use_attribute_docstrings``), so ``docs/configuration.md`` and error messages say the
same thing as the code.

Mistakes are reported before any model is loaded, as one ``ConfigError`` listing every problem:

- an unknown key names its dotted location, the file line, the nearest valid key and all valid keys;
- a bad value names the key, what was given and what is allowed (``Literal`` choices listed).

``dump_config`` writes the resolved config (defaults filled in, overrides applied) into the run
directory so a run can be reproduced from its folder alone.

Modules, each importing only those above it (``_base`` <- ``shared`` <- the recipe modules <- this
file):

- ``_base.py``: ``_Section`` (the base of every section), ``ConfigError``, ``load_config``,
  ``parse_overrides``, ``apply_overrides``, ``dump_config``, ``describe_fields``;
- ``shared.py``: the sections more than one recipe uses (model, LoRA, optimizer, checkpoints,
  logging, env and injection, tasks and curriculum, rollout settings, tree rollouts, evaluation);
- ``sft.py``, ``rl.py``, ``dpo.py``, ``distill.py``, ``synthesize.py``: one recipe's config each,
  with the sections only it has.

Every name is importable from ``tracegym.config`` itself, as before the split.
"""

from __future__ import annotations

from tracegym.config._base import (
    ConfigError,
    apply_overrides,
    dump_config,
    load_config,
    parse_overrides,
)
from tracegym.config.distill import DistillConfig, TeacherConfig
from tracegym.config.dpo import DPOConfig, DPODataConfig, DPOLossConfig
from tracegym.config.rl import AdvantageConfig, RLConfig
from tracegym.config.sft import SFTConfig, SFTDataConfig
from tracegym.config.shared import (
    CheckpointConfig,
    EnvConfig,
    InjectionConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RLEvalConfig,
    RLRolloutConfig,
    RolloutSettings,
    TasksConfig,
)

# Names that were importable from the single-file ``tracegym.config`` without being in ``__all__``:
# kept importable from here (``_Section`` is subclassed by ``recipes/demo.py``).
from tracegym.config._base import (  # noqa: F401
    C,
    _describe_errors,
    _dotted,
    _Loader,
    _merge_under,
    _optional_section,
    _section_at,
    _Section,
    _yaml_lines,
    _yaml_load,
    describe_fields,
)
from tracegym.config.rl import (  # noqa: F401
    ExecutorConfig,
    ExpertReplayConfig,
    GuidanceConfig,
    HealthConfig,
    RoleConfig,
    SelfPlayConfig,
    preset_settings,
)
from tracegym.config.shared import (  # noqa: F401
    ATTACK_KINDS,
    AttackKind,
    CurriculumConfig,
    TreeConfig,
    UntrustedToolOutput,
)
from tracegym.config.synthesize import (  # noqa: F401
    SynthesisStudentConfig,
    SynthesisTeacherConfig,
    SynthesizeConfig,
)

__all__ = [
    "ConfigError",
    "ModelConfig",
    "LoraConfig",
    "OptimConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "SFTDataConfig",
    "SFTConfig",
    "EnvConfig",
    "InjectionConfig",
    "TasksConfig",
    "RolloutSettings",
    "RLRolloutConfig",
    "AdvantageConfig",
    "RLEvalConfig",
    "RLConfig",
    "DPODataConfig",
    "DPOLossConfig",
    "DPOConfig",
    "TeacherConfig",
    "DistillConfig",
    "load_config",
    "parse_overrides",
    "apply_overrides",
    "dump_config",
]
