"""``tracegym distill``: on-policy distillation from a teacher in an environment, from a YAML config.

    tracegym distill --config examples/distill_calculator.yaml
    tracegym distill --config examples/distill_calculator.yaml steps=20 teacher.model=runs/sft_calculator/final
    tracegym distill --config examples/distill_calculator.yaml loss=jsd jsd_beta=0.5
    tracegym distill --config examples/distill_calculator.yaml teacher.engine=openai \\
        teacher.base_url=http://127.0.0.1:8000/v1 teacher.model=my-teacher    # a served teacher (vllm serve)
    tracegym distill --config examples/distill_calculator.yaml --resume

The teacher must share the student's tokenizer (checked before training starts; for a served
teacher, by how the server reads the student's ids of probe strings).
"""

from __future__ import annotations

import argparse

from tracegym.commands._config import add_config_arguments

NAME = "distill"
HELP = ("On-policy distillation (reverse KL per token, or GKD's JSD) from a local teacher or one served by "
        "vLLM / an OpenAI-compatible server, from a YAML config.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(
        parser, "config overrides, VALUE parsed as YAML: steps=20 teacher.model=runs/sft/final loss=jsd "
                "teacher.engine=openai teacher.base_url=http://127.0.0.1:8000/v1"
    )


def check_config(cfg: object) -> None:
    """The env section (its name and options, read from the env factory's signature) and the
    teacher's engine options (read from the engine's constructor), before any model loads; raises
    ``ConfigError`` naming the key."""
    from tracegym.commands._config import check_env_config
    from tracegym.config import ConfigError
    from tracegym.engines import engine_options

    problems = check_env_config(cfg.env.name, cfg.env.options)  # type: ignore[attr-defined]
    teacher = cfg.teacher  # type: ignore[attr-defined]
    if teacher.engine != "hf" and teacher.engine_options:
        allowed, open_ended = engine_options(teacher.engine)
        allowed = tuple(k for k in allowed if k not in ("base_url", "api_key_env", "transport"))  # teacher keys, tests
        unknown = sorted(k for k in teacher.engine_options if k not in allowed)
        if unknown and not open_ended:
            problems.append(f"teacher.engine_options: engine {teacher.engine!r} has no option "
                            f"{', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")
    if problems:
        raise ConfigError(problems)


def run(args: argparse.Namespace) -> int:
    from tracegym.commands._config import print_done, train_from_config
    from tracegym.config import DistillConfig

    result = train_from_config(DistillConfig, args, "tracegym.recipes.distill:train_distill", check=check_config)
    if isinstance(result, int):
        return result
    return print_done("distill", result, ("distill/reverse_kl", "eval/pass@1"), digits=4)
