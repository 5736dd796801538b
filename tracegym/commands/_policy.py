"""What ``tracegym rollout`` and ``tracegym eval`` share: their common arguments and the policy they run.

The leading underscore keeps this module out of the subcommand discovery of ``tracegym.cli``.

    add_env_arguments(parser, default_split="test")
    add_injection_arguments(parser)                 # --injection-rate ...: prompt-injection episodes
    add_policy_arguments(parser)
    add_run_arguments(parser, default_tasks=20, default_samples=8)
    ...
    env_options, tasks = make_tasks(args)          # UsageError: a clear message, exit code 2
    setup = build_policy(args)                      # "expert" or an engine, renderer, tokenizer, model
    config = rollout_config(args, setup, max_turns=8, temperature=1.0)
    result = run_policy(args, setup, tasks, env_options, config, writer=w, failed_writer=w)

The policy: ``--policy expert`` records the env's scripted expert (through the tokenizer and
renderer of ``--model``); otherwise ``--model`` runs on ``--engine`` (hf: in this process, on CPU;
vllm: on a GPU; openai: an OpenAI-compatible server). ``--adapter PATH`` applies a LoRA adapter
folder (``adapter_config.json``, written by ``tracegym sft`` / ``tracegym rl``) merged into the
weights of ``--model``, which defaults to the base model the adapter names (``tracegym.json``).
Passing the adapter folder itself as ``--model`` means the same.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from tracegym.envs.base import Task
    from tracegym.render.base import Renderer
    from tracegym.rollout import RolloutConfig, RolloutResult

log = logging.getLogger("tracegym.commands")

ENGINES = ("hf", "vllm", "openai")


class UsageError(ValueError):
    """Arguments that cannot work together (or name nothing that exists); the command prints the
    message and exits with code 2."""


def print_error(message: object) -> None:
    print(f"error: {message}", file=sys.stderr)


# --- argument types and registration ---------------------------------------------------------------


def key_value(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with the value parsed as YAML (``3`` -> 3, ``[1, 2]`` -> [1, 2], ``x`` -> "x")."""
    import yaml

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    if not key.strip():
        raise argparse.ArgumentTypeError(f"empty KEY in {text!r}")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"cannot parse the value of {text!r}: {exc}") from exc


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_env_arguments(parser: argparse.ArgumentParser, *, default_split: str, env_required: bool = True) -> None:
    """``--env``, ``--env-option``, ``--split``, ``--task-seed`` and ``--plugin`` (modules that register
    envs, imported by ``tracegym.cli`` before the command runs)."""
    from tracegym.commands._config import add_plugin_argument

    parser.add_argument("--env", required=env_required, help="environment name (see `tracegym envs`; --plugin adds more)")
    parser.add_argument("--env-option", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                        help="env constructor option, value parsed as YAML (repeatable), e.g. num_calls=3")
    parser.add_argument("--split", default=default_split, choices=["train", "test"],
                        help=f"task split (default {default_split})")
    parser.add_argument("--task-seed", type=int, default=0, help="seed of the task generator (default 0)")
    add_plugin_argument(parser)


def check_env_args(args: argparse.Namespace) -> None:
    """UsageError (one line: the nearest env name, or the allowed options) when ``--env`` names no
    env or ``--env-option`` gives an option it does not take; nothing is built or loaded."""
    from tracegym.envs.registry import check_env_options

    try:
        check_env_options(args.env, dict(args.env_option))
    except (ValueError, TypeError, ImportError) as exc:
        raise UsageError(f"cannot make env {args.env!r}: {exc}") from exc
    strategy = getattr(args, "strategy", "chains")
    if strategy != "chains" or getattr(args, "strategy_option", None):
        from tracegym.rollout.strategies import strategy_problems
        from tracegym.serve.harness import agent_problems  # registers the harness strategy

        problems = strategy_problems(strategy, dict(args.strategy_option)) \
            or agent_problems(strategy, dict(args.strategy_option))
        if problems:
            raise UsageError(problems[0].replace("rollout.strategy_options", "--strategy-option")
                             .replace("rollout.strategy", "--strategy"))


def _attack_list(text: str) -> list[str]:
    from tracegym.config import ATTACK_KINDS

    kinds = [item.strip() for item in text.split(",") if item.strip()]
    bad = [k for k in kinds if k not in ATTACK_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated attacks out of {', '.join(ATTACK_KINDS)}, got {text!r}")
    return kinds


def add_injection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--injection-rate`` and its settings: the episodes run in ``InjectionEnv`` (docs/safety.md)."""
    group = parser.add_argument_group("prompt injection (docs/safety.md)")
    group.add_argument("--injection-rate", type=float, default=None, metavar="RATE",
                       help="inject an attack into the tool results of this fraction of the tasks (0..1); "
                            "default: off. eval.json then reports asr and utility_clean / utility_injected")
    group.add_argument("--injection-attacks", type=_attack_list, default=None, metavar="A,B",
                       help="attacks to draw from (default: forbidden_tool,exfiltrate,answer_override)")
    group.add_argument("--injection-penalty", type=float, default=0.0, metavar="P",
                       help="reward taken off when the agent follows an attack (default 0: rewards stay the task's)")
    group.add_argument("--injection-seed", type=int, default=0, help="seed of the injected-task choice (default 0)")


def injection_settings(args: argparse.Namespace) -> Any:
    """The ``InjectionConfig`` of ``--injection-*``, or None (off); UsageError for bad values."""
    from pydantic import ValidationError

    from tracegym.config import ATTACK_KINDS, InjectionConfig

    rate = getattr(args, "injection_rate", None)
    if rate is None:
        return None
    try:
        return InjectionConfig(rate=rate, attacks=args.injection_attacks or list(ATTACK_KINDS),
                               penalty=args.injection_penalty, seed=args.injection_seed)
    except ValidationError as exc:
        problems = "; ".join(f"--injection-{str(e['loc'][0])}: {e['msg']}" for e in exc.errors())
        raise UsageError(problems) from None


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model name or local folder (default: the base model of --adapter, else smollm2-135m); "
                             "for --engine openai the server's model name")
    parser.add_argument("--adapter", default=None, metavar="PATH",
                        help="LoRA adapter folder (adapter_config.json) to merge into --model before sampling "
                             "(hf and vllm engines)")
    parser.add_argument("--engine", default="hf", choices=list(ENGINES), help="inference engine (default hf)")
    parser.add_argument("--policy", default="model", choices=["model", "expert"],
                        help="'expert' records the env's scripted expert on the same token path")
    parser.add_argument("--renderer", default=None,
                        help="chat-template renderer (default: the adapter's, else the model's)")
    parser.add_argument("--untrusted-tool-output", default=None, choices=["none", "delimiters", "role"],
                        help="how tool results are shown (docs/safety.md): the template's way, between "
                             "<untrusted_input> markers, or in a role of their own (default: what the adapter "
                             "was trained with, else none)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for rendering (default: the model's; smollm2-135m for --engine openai)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="openai engine: server URL")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="openai engine: env var holding the key")


def add_run_arguments(parser: argparse.ArgumentParser, *, default_tasks: int, default_samples: int) -> None:
    """Sizes, limits and sampling settings both commands take (temperature is per command: its
    default differs)."""
    parser.add_argument("--tasks", type=positive_int, default=default_tasks, help=f"number of tasks (default {default_tasks})")
    parser.add_argument("--samples", type=positive_int, default=default_samples,
                        help=f"samples per task (default {default_samples})")
    parser.add_argument("--max-tokens-per-turn", type=positive_int, default=256)
    parser.add_argument("--max-tokens-per-episode", type=positive_int, default=None)
    parser.add_argument("--max-context", type=positive_int, default=None, help="default: the model's context length")
    parser.add_argument("--timeout", type=float, default=None, help="wall-clock limit per episode (s)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--concurrency", type=positive_int, default=64, help="episodes alive at once (default 64)")
    parser.add_argument("--batching", choices=("continuous", "per_turn"), default="continuous",
                        help="hf engine: turns join one running batch (continuous, default) or wait for one "
                             "generate call per turn (per_turn)")
    parser.add_argument("--context", default="full", metavar="POLICY[:KEEP][@AT]",
                        help="what prompts show of a long history: full (default), window:K (the task and the last K "
                             "turns), observation_masking:K (older tool results replaced by a placeholder) or "
                             "summarize:K@N (past N prompt tokens the model summarizes its history; the summary and "
                             "the last K turns stay); docs/rollouts.md, Context policies")
    parser.add_argument("--strategy", default="chains",
                        help="rollout strategy (tracegym.rollout.strategies: chains, tree, or a --plugin's; default chains)")
    parser.add_argument("--strategy-option", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                        help="an option of the strategy (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", required=True, help="output folder")


# --- building what runs ---------------------------------------------------------------------------


def make_tasks(args: argparse.Namespace) -> tuple[dict[str, Any], list[Task]]:
    """``(env_options, tasks)`` of ``args.env``; UsageError when the env cannot be made."""
    from tracegym.envs import make

    env_options = dict(args.env_option)
    try:
        tasks = make(args.env, **env_options).tasks(args.split, n=args.tasks, seed=args.task_seed)
    except Exception as exc:  # noqa: BLE001 - any failure here is a usage problem: say it, no traceback
        raise UsageError(f"cannot make env {args.env!r} with {env_options}: {exc}") from exc
    if not tasks:
        raise UsageError(f"env {args.env!r} gave no {args.split} tasks")
    return env_options, list(tasks)


# Turn limit of an env that states none (the episode loop's own default).
FALLBACK_MAX_TURNS = 50


def env_turn_limit(args: argparse.Namespace) -> int:
    """The env's own turn limit: ``max_turns`` of ``--env`` made with its ``--env-option`` values
    (``ToolEnv.max_turns``: the option when given, else the env's default); ``FALLBACK_MAX_TURNS``
    for an env without one. The default of ``rollout --max-turns`` and of ``eval --turns``, so a
    recording is never cut below the limit the env itself enforces."""
    from tracegym.envs import make

    try:
        env = make(args.env, **dict(args.env_option))
    except Exception as exc:  # noqa: BLE001 - same message as make_tasks
        raise UsageError(f"cannot make env {args.env!r} with {dict(args.env_option)}: {exc}") from exc
    try:
        limit = getattr(env, "max_turns", None)
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - closing a probe env must not fail the command
                pass
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
        return limit
    return FALLBACK_MAX_TURNS


@dataclass
class PolicySetup:
    """Everything ``run_rollouts`` needs about the policy, and what to record about it."""

    policy: Any
    """``"expert"``, or an engine (``HFEngine``, ``VLLMEngine``, ``OpenAIEngine``)."""
    renderer: Renderer
    tokenizer: Any
    model_name: str
    """The model (``--model``, or the base model of the adapter)."""
    adapter: str | None
    """The LoRA adapter folder merged into the model, if any."""
    engine_name: str | None
    """None for the expert."""
    policy_name: str
    """Recorded in ``Trajectory.policy``: "expert", the adapter folder, or the model name."""
    model: Any | None = None
    """The model in this process (hf engine), adapter merged."""
    gap_model: Any | None = None
    """The model that re-scores sampled tokens for the engine/trainer log-prob gap (hf only)."""

    def describe(self) -> dict[str, Any]:
        """JSON-ready record of the policy (for summary.json / eval.json)."""
        return {
            "model": self.model_name,
            "adapter": self.adapter,
            "engine": self.engine_name,
            "policy": self.policy_name,
            "renderer": getattr(self.renderer, "name", type(self.renderer).__name__),
            "untrusted_tool_output": getattr(self.renderer, "untrusted_tool_output", "none"),
        }

    def default_max_context(self) -> int | None:
        return getattr(getattr(self.model, "config", None), "max_position_embeddings", None)

    def close(self) -> None:
        close = getattr(self.policy, "close", None)
        if callable(close):
            close()


def _adapter_base(name: str | None) -> str | None:
    """The base model if ``name`` is a LoRA adapter folder, else None (known names and server-side
    model names are never adapters)."""
    from tracegym.models import KNOWN_MODELS, adapter_base_model, resolve_model_name

    if name is None:
        return None
    try:
        resolved = resolve_model_name(name)
    except ValueError:
        return None  # not a local model: let the engine report it
    if resolved in KNOWN_MODELS or not Path(resolved).is_dir():
        return None
    try:
        return adapter_base_model(resolved)
    except (OSError, ValueError) as exc:  # unreadable JSON or no base model named
        raise UsageError(str(exc)) from exc


def _same_model(a: str, b: str) -> bool:
    from tracegym.models import resolve_model_name

    try:
        return resolve_model_name(a) == resolve_model_name(b)
    except ValueError:
        return a == b


def resolve_model_and_adapter(model: str | None, adapter: str | None) -> tuple[str, str | None, str | None]:
    """``(model, adapter, renderer_hint)`` from ``--model`` / ``--adapter``.

    An adapter folder passed as ``--model`` becomes the adapter; the model then is the base the
    adapter names. ``renderer_hint`` is the renderer the adapter's ``tracegym.json`` records.
    """
    import json

    from tracegym.models import DEFAULT_MODEL, adapter_base_model

    base_of_model = _adapter_base(model)
    if adapter is not None:
        if not (Path(adapter) / "adapter_config.json").is_file():
            raise UsageError(f"--adapter {adapter}: not a LoRA adapter folder (no adapter_config.json)")
        if base_of_model is not None:
            raise UsageError(f"--model {model} is itself an adapter folder; pass its base model as --model (or drop it)")
        try:
            base = adapter_base_model(adapter)
        except (OSError, ValueError):
            base = None  # no base model named: fine when --model gives it
        if model is None:
            if base is None:
                raise UsageError(f"--adapter {adapter} names no base model it could be loaded on; pass --model")
            model = base
        elif base is not None and not _same_model(model, base):
            log.warning("adapter %s was trained on %s but is applied to %s", adapter, base, model)
    elif base_of_model is not None:
        adapter, model = model, base_of_model
    renderer_hint = None
    if adapter is not None:
        info = Path(adapter) / "tracegym.json"
        if info.is_file():
            try:
                renderer_hint = json.loads(info.read_text(encoding="utf-8")).get("renderer")
            except (OSError, ValueError) as exc:
                raise UsageError(f"cannot read {info}: {exc}") from exc
    return model or DEFAULT_MODEL, adapter, renderer_hint


def _recorded_untrusted_mode(adapter: str | None) -> Any:
    """The ``untrusted_tool_output`` an adapter was trained with (its ``tracegym.json``), else "none"."""
    import json

    info = Path(adapter) / "tracegym.json" if adapter is not None else None
    if info is None or not info.is_file():
        return "none"
    try:
        recorded = json.loads(info.read_text(encoding="utf-8")).get("untrusted_tool_output")
    except (OSError, ValueError, AttributeError):
        return "none"
    return recorded if recorded in ("none", "delimiters", "role") else "none"


def _merge_adapter(model: Any, adapter: str) -> Any:
    """``model`` with the LoRA adapter in ``adapter`` merged into its weights (a plain model again)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def build_policy(args: argparse.Namespace) -> PolicySetup:
    """Load what ``args`` names (see the module doc). UsageError for bad combinations or unknown models."""
    from tracegym.models import load, load_tokenizer
    from tracegym.render import get_renderer

    model_name, adapter, renderer_hint = resolve_model_and_adapter(args.model, args.adapter)
    untrusted = getattr(args, "untrusted_tool_output", None) or _recorded_untrusted_mode(adapter)
    expert = args.policy == "expert"
    if adapter is not None and expert:
        raise UsageError("--adapter has no effect with --policy expert (the scripted expert uses no model weights)")
    if adapter is not None and args.engine == "openai":
        raise UsageError("--adapter needs a local model (--engine hf or vllm); with --engine openai serve the "
                         "adapter from the server and name it with --model")

    model = None
    try:
        if expert:
            tokenizer = load_tokenizer(args.tokenizer or model_name)
        elif args.engine == "hf":
            model, tokenizer = load(model_name)
            if adapter is not None:
                model = _merge_adapter(model, adapter)
            if args.tokenizer:
                tokenizer = load_tokenizer(args.tokenizer)
        elif args.engine == "openai":
            tokenizer = load_tokenizer(args.tokenizer or "smollm2-135m")
        else:
            tokenizer = load_tokenizer(args.tokenizer or model_name)
        renderer = get_renderer(args.renderer or renderer_hint or model_name, tokenizer,
                                untrusted_tool_output=untrusted)
    except (ValueError, FileNotFoundError) as exc:  # UnknownModelError is a ValueError
        raise UsageError(str(exc)) from exc

    policy: Any
    gap_model = None
    if expert:
        policy = "expert"
    else:
        from tracegym.engines import make_engine

        if args.engine == "hf":
            policy = make_engine("hf", model=model, tokenizer=tokenizer, renderer=renderer,
                                 max_batch_size=args.concurrency)
            gap_model = model
        elif args.engine == "openai":
            policy = make_engine("openai", model=model_name, base_url=args.base_url, api_key_env=args.api_key_env)
        else:
            policy = make_engine("vllm", model=model_name, renderer=renderer)
            if adapter is not None:
                from peft import PeftModel

                base, _ = load(model_name)
                # the engine merges the adapter deltas into the weights it sends to vLLM
                policy.update_weights(PeftModel.from_pretrained(base, adapter))
                del base

    return PolicySetup(
        policy=policy,
        renderer=renderer,
        tokenizer=tokenizer,
        model_name=model_name,
        adapter=adapter,
        engine_name=None if expert else args.engine,
        policy_name="expert" if expert else (adapter or model_name),
        model=model,
        gap_model=gap_model,
    )


def rollout_config(
    args: argparse.Namespace,
    setup: PolicySetup,
    *,
    max_turns: int,
    temperature: float,
    on_env_error: str = "exclude",
    measure_logprob_gap: bool = False,
) -> RolloutConfig:
    """The ``RolloutConfig`` of ``args``; UsageError (naming the field) for invalid values."""
    from pydantic import ValidationError

    from tracegym.rollout import RolloutConfig

    max_context = args.max_context if args.max_context is not None else setup.default_max_context()
    try:
        return RolloutConfig(
            max_turns=max_turns,
            max_tokens_per_turn=args.max_tokens_per_turn,
            max_tokens_per_episode=args.max_tokens_per_episode,
            max_context=max_context,
            episode_timeout_s=args.timeout,
            temperature=temperature,
            top_p=args.top_p,
            seed=args.seed,
            samples_per_task=args.samples,
            concurrency=args.concurrency,
            batching=args.batching,
            context=context_arg(getattr(args, "context", "full")),
            on_env_error=on_env_error,
            measure_logprob_gap=measure_logprob_gap and setup.gap_model is not None,
        )
    except ValidationError as exc:
        raise UsageError(str(exc)) from exc


def context_arg(value: str) -> dict[str, Any]:
    """``--context POLICY[:KEEP][@AT]`` as ``rollout.context`` (UsageError naming the flag otherwise);
    ``@AT`` (``summarize`` only) is its ``summarize_at``."""
    rest, _, at = value.partition("@")
    policy, _, keep = rest.partition(":")
    bad_number = any(x and (not x.isdigit() or int(x) == 0) for x in (keep, at))
    if policy not in ("full", "window", "observation_masking", "summarize") or bad_number \
            or ("@" in value and (policy != "summarize" or not at)):
        raise UsageError(f"--context {value!r}: expected full, window[:K], observation_masking[:K] or "
                         "summarize[:K][@N] (summarize past N prompt tokens) with K, N >= 1")
    return {"policy": policy, **({"keep_turns": int(keep)} if keep else {}), **({"summarize_at": int(at)} if at else {})}


def run_policy(
    args: argparse.Namespace,
    setup: PolicySetup,
    tasks: Sequence[Task],
    env_options: dict[str, Any],
    config: RolloutConfig,
    *,
    writer: Any | None = None,
    failed_writer: Any | None = None,
) -> RolloutResult:
    """Run every episode (``len(tasks) * config.samples_per_task``) and return the result; with
    ``--injection-rate``, in ``InjectionEnv`` around the env."""
    import asyncio

    from tracegym.envs.injection import env_source
    from tracegym.rollout.strategies import RolloutJob, run_strategy

    from tracegym.envs import make
    from tracegym.envs.team import TeamEnv

    probe = make(args.env, **env_options)
    team = isinstance(probe, TeamEnv)
    probe.close()
    if team:  # a team env: one trajectory per role per episode, the same policy (or expert) in every role
        from tracegym.rollout.team import run_team_rollouts

        if injection_settings(args) is not None:
            raise UsageError(f"--injection-rate is not supported on the team env {args.env!r}")
        if args.strategy != "chains":
            raise UsageError(f"--strategy {args.strategy} is not supported on the team env {args.env!r} (chains only)")
        result = asyncio.run(run_team_rollouts(args.env, tasks, setup.policy, setup.renderer, config,
                                               env_options=env_options, writer=writer, policy_name=setup.policy_name))
        if failed_writer is not None:
            failed_writer.write_all(result.failed)
        return result
    env, options = env_source(args.env, env_options, injection_settings(args))
    job = RolloutJob(env, tasks, setup.policy, setup.renderer, config, env_options=options, writer=writer,
                     failed_writer=failed_writer, policy_name=setup.policy_name, gap_model=setup.gap_model,
                     progress=not args.no_progress)
    return asyncio.run(run_strategy(args.strategy, job, dict(args.strategy_option)))
