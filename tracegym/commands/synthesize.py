"""``tracegym synthesize``: a teacher plays an env; its episodes are filtered and re-rendered for a student.

    tracegym synthesize --env calculator --tasks 200 --samples 4 --teacher expert --out runs/synth
    TEACHER_KEY=sk-... tracegym synthesize --env calculator --tasks 100 --samples 4 \\
        --teacher https://api.example.com/v1 --teacher-model big-model --api-key-env TEACHER_KEY \\
        --student smollm2-135m --filters success,pareto,recovery:prefer,dedupe --out runs/synth
    tracegym synthesize --env calculator --teacher runs/rl/final --student smollm2-135m --out runs/synth
    tracegym synthesize --config examples/synthesize_calculator.yaml [tasks=50 teacher.source=URL ...]

``--teacher`` is ``expert`` (the env's scripted expert), a URL of an OpenAI-compatible server (the
model id from ``--teacher-model``, default the server's only model; the key from the environment
variable ``--api-key-env``, never printed or written), or a local model name/folder (hf engine, its
own renderer or ``--teacher-renderer``). Writes ``OUT/trajectories.jsonl`` (SFT-ready for
``--student``), ``OUT/teacher.jsonl`` (every teacher episode, before the filters) and
``OUT/summary.json``; see ``tracegym/recipes/synthesize.py`` and docs/synthesis.md.

With ``--config`` every setting comes from a YAML file (``SynthesizeConfig``: the flags' names as
keys, ``teacher``/``student``/``env`` as sections, ``filters`` as a list whose items may carry
options); ``KEY=VALUE`` overrides change it, the flags are then refused (one source of truth), and
the resolved config is written to ``OUT/config.yaml``.
"""

from __future__ import annotations

import argparse

from tracegym.commands._policy import add_env_arguments, positive_int

NAME = "synthesize"
HELP = "Let a teacher (expert, endpoint or model) play an env; filter and re-render its episodes as SFT data."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", default=None, metavar="FILE",
                        help="all settings from a YAML file (SynthesizeConfig, docs/configuration.md); then only "
                             "KEY=VALUE overrides, no other flags")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="with --config: overrides, VALUE parsed as YAML: tasks=50 'filters=[success, pareto]'")
    parser.add_argument("--print-config", action="store_true", help="with --config: print the resolved config and exit")
    add_env_arguments(parser, default_split="train", env_required=False)
    parser.add_argument("--tasks", type=positive_int, default=8, help="number of tasks (default 8)")
    parser.add_argument("--samples", type=positive_int, default=4, help="teacher samples per task (default 4)")
    parser.add_argument("--teacher", default=None, metavar="expert|MODEL|URL",
                        help="'expert', a local model name/folder, or an OpenAI-compatible server URL "
                             "(http://host:port/v1)")
    parser.add_argument("--teacher-model", default=None,
                        help="endpoint teacher: the model id (default: the server's only model)")
    parser.add_argument("--teacher-renderer", default=None, help="local teacher: its renderer (default: the model's)")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY",
                        help="endpoint teacher: the environment variable holding the API key (default OPENAI_API_KEY)")
    parser.add_argument("--student", default="smollm2-135m",
                        help="student model whose tokenizer the data is for (default smollm2-135m)")
    parser.add_argument("--student-renderer", default=None, help="student chat template (default: the student's)")
    parser.add_argument("--filters", default="success,dedupe",
                        help="filters applied in order, comma-separated: success, pareto, recovery, dedupe; options "
                             "after ':' (success:min_reward=0.5, recovery:prefer:per_task=2); 'none' for none "
                             "(default success,dedupe)")
    parser.add_argument("--max-turns", type=positive_int, default=None,
                        help="assistant turns per episode (default: the env's limit)")
    parser.add_argument("--max-tokens-per-turn", type=positive_int, default=512,
                        help="teacher tokens per turn (default 512)")
    parser.add_argument("--max-context", type=positive_int, default=None,
                        help="end an episode whose next prompt (in student tokens) exceeds this (default: no limit)")
    parser.add_argument("--temperature", type=float, default=1.0, help="teacher sampling temperature (default 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--timeout", type=float, default=None, help="wall-clock limit per episode (s)")
    parser.add_argument("--concurrency", type=positive_int, default=16, help="episodes alive at once (default 16)")
    parser.add_argument("--parquet", action="store_true", help="also write OUT/trajectories.parquet")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", default=None, help="output folder")


def _setup(args: argparse.Namespace) -> tuple:
    """Everything checked and built before the teacher runs; UsageError (exit code 2) otherwise."""
    from pydantic import ValidationError

    from tracegym.commands._policy import UsageError, check_env_args, env_turn_limit, make_tasks
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig
    from tracegym.data.filters import parse_filters
    from tracegym.recipes.synthesize import TeacherError, make_teacher

    check_env_args(args)
    try:
        filters = parse_filters(args.filters)
    except ValueError as exc:
        raise UsageError(f"--filters: {exc}") from exc
    if not args.api_key_env.strip():
        raise UsageError("--api-key-env must name an environment variable")
    env_options, tasks = make_tasks(args)
    max_turns = args.max_turns if args.max_turns is not None else env_turn_limit(args)
    try:
        tokenizer = load_tokenizer(args.student)
        renderer = get_renderer(args.student_renderer or args.student, tokenizer)
    except (ValueError, OSError) as exc:  # an unknown model or renderer, a folder without a tokenizer
        raise UsageError(f"--student {args.student}: {exc}") from exc
    try:
        config = RolloutConfig(
            max_turns=max_turns, max_tokens_per_turn=args.max_tokens_per_turn, max_context=args.max_context,
            episode_timeout_s=args.timeout, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
            samples_per_task=args.samples, concurrency=args.concurrency,
        )
    except ValidationError as exc:
        # name the flag, not the config field: "--temperature: Input should be greater than or equal to 0"
        flag = {"episode_timeout_s": "timeout"}
        problem = "; ".join(
            f"--{flag.get(str(e['loc'][0]), str(e['loc'][0])).replace('_', '-')}: {e['msg']}" for e in exc.errors()
        )
        raise UsageError(problem) from exc
    # Last: an endpoint teacher may be asked which model it serves, a local one is loaded.
    try:
        teacher = make_teacher(args.teacher, model=args.teacher_model, api_key_env=args.api_key_env,
                               renderer=args.teacher_renderer, max_batch_size=args.concurrency)
    except TeacherError as exc:
        raise UsageError(f"--teacher {args.teacher}: {exc}") from exc
    return env_options, tasks, filters, renderer, config, teacher


# flag (argparse dest) -> SynthesizeConfig key, for the flags --config replaces
CONFIG_KEYS = {
    "env": "env.name", "env_option": "env.options", "split": "split", "tasks": "tasks", "task_seed": "task_seed",
    "samples": "samples", "teacher": "teacher.source", "teacher_model": "teacher.model",
    "teacher_renderer": "teacher.renderer", "api_key_env": "teacher.api_key_env", "student": "student.model",
    "student_renderer": "student.renderer", "filters": "filters", "max_turns": "max_turns",
    "max_tokens_per_turn": "max_tokens_per_turn", "max_context": "max_context", "temperature": "temperature",
    "top_p": "top_p", "seed": "seed", "timeout": "timeout", "concurrency": "concurrency", "parquet": "parquet",
    "out": "output_dir",
}


def apply_config(args: argparse.Namespace, parser_defaults: dict) -> object | int:
    """``args`` filled from ``--config`` + overrides (the SynthesizeConfig, or an exit code: 2 for a
    bad config or a flag given beside it, 0 after ``--print-config``)."""
    import sys

    from tracegym.commands._config import load_for_command
    from tracegym.config import SynthesizeConfig

    given = [k for k in CONFIG_KEYS if getattr(args, k) != parser_defaults.get(k)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        print(f"error: {flag} cannot be used with --config: set {CONFIG_KEYS[given[0]]}=VALUE instead", file=sys.stderr)
        return 2
    cfg = load_for_command(SynthesizeConfig, args)
    if isinstance(cfg, int):
        return cfg
    for flag, key in CONFIG_KEYS.items():  # each flag's value read from its config key
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        setattr(args, flag, list(value.items()) if flag == "env_option" else value)
    return cfg


def run(args: argparse.Namespace) -> int:
    import logging
    import sys

    from tracegym.commands._policy import UsageError
    from tracegym.recipes.synthesize import synthesize

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = None
    if args.config is not None:
        defaults = argparse.ArgumentParser()
        add_arguments(defaults)
        cfg = apply_config(args, vars(defaults.parse_args([])))
        if isinstance(cfg, int):
            return cfg
    else:
        if args.overrides or args.print_config:
            raise UsageError("KEY=VALUE overrides and --print-config need --config")
        missing = [flag for flag, value in (("--env", args.env), ("--teacher", args.teacher), ("--out", args.out))
                   if value is None]
        if missing:
            raise UsageError(f"{', '.join(missing)} required (or --config FILE)")
    env_options, tasks, filters, renderer, config, teacher = _setup(args)
    if cfg is not None:
        from tracegym.config import dump_config

        dump_config(cfg, args.out)
    try:
        result = synthesize(
            args.env, env_options, tasks, teacher, renderer, args.samples, filters, args.out,
            config=config, student=args.student, parquet=args.parquet, progress=not args.no_progress,
        )
    finally:
        teacher.close()
    s = result.summary
    described = s["teacher"]
    print(f"teacher {teacher.name} ({described['kind']}): {s['episodes']} episodes, {s['teacher_failed']} failed, "
          f"success rate {s['success_rate']:.3f}, mean reward {s['mean_reward']:.3f}")
    for line in s["errors"][:3]:
        print(f"teacher error: {line}")
    print(f"re-rendered {s['rendered']} for the {s['student']['renderer']} template ({args.student})")
    for count in s["filters"]:
        print(f"filter {count['filter']}: kept {count['after']} of {count['before']}")
    print(f"kept {s['kept']} trajectories of {s['kept_tasks']} tasks ({s['generated_tokens']} assistant tokens)")
    print(f"wrote {args.out}/trajectories.jsonl, teacher.jsonl and summary.json")
    if s["kept"] == 0:
        print("error: no trajectory passed the filters (see summary.json)", file=sys.stderr)
        return 1
    return 0
