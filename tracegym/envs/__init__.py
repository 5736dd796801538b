"""Environments: the ``Env`` interface, tool environments, the registry and the env checker.

    from tracegym.envs import make, list_envs
    env = make("calculator", num_calls=3)
"""

from __future__ import annotations

from tracegym.envs.base import Env, EnvSnapshot, SnapshotUnsupported, Task
from tracegym.envs.check import CheckReport, EnvCheckError, check_env
from tracegym.envs.episode import (
    Action,
    ContextExhausted,
    Observation,
    Policy,
    PolicyError,
    TokenData,
    play_episode,
    run_episode,
    run_episodes,
)
from tracegym.envs.registry import (
    BUILTIN_ENVS,
    EnvLoadError,
    UnknownEnvError,
    env_factory,
    list_envs,
    make,
    register,
    unregister,
)
from tracegym.envs.mcp import MCPServerConfig, MCPToolEnv, MCPToolProvider, close_shared_providers
from tracegym.envs.tools import ToolEnv, extract_answer, tool, tool_schema

__all__ = [
    "Action",
    "BUILTIN_ENVS",
    "CheckReport",
    "ContextExhausted",
    "Env",
    "EnvSnapshot",
    "EnvCheckError",
    "EnvLoadError",
    "MCPServerConfig",
    "MCPToolEnv",
    "MCPToolProvider",
    "Task",
    "TokenData",
    "ToolEnv",
    "UnknownEnvError",
    "env_factory",
    "extract_answer",
    "list_envs",
    "make",
    "Observation",
    "play_episode",
    "Policy",
    "PolicyError",
    "register",
    "run_episode",
    "run_episodes",
    "SnapshotUnsupported",
    "check_env",
    "close_shared_providers",
    "tool",
    "tool_schema",
    "unregister",
]
