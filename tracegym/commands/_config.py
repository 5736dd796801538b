"""Config loading shared by the config-driven commands (``sft``, ``rl``, ``demo``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def load_for_command(cls: type, args: argparse.Namespace, check: Callable[[Any], None] | None = None) -> Any | int:
    """``cls`` from ``--config`` + ``KEY=VALUE`` overrides, or an exit code.

    A bad config prints every problem (bad key, nearest valid key, allowed values) and gives 2;
    ``--print-config`` prints the resolved config and gives 0. ``check`` may raise ``ConfigError``
    for sections validated outside ``cls`` (e.g. ``policy_loss``).
    """
    import yaml

    from tracegym.config import ConfigError, load_config

    try:
        cfg = load_config(cls, args.config, args.overrides)
        if check is not None:
            check(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "print_config", False):
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    return cfg
