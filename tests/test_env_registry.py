"""The env registry: make/register/list_envs, option checking, lazy built-ins, entry-point plugins."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest

from tracegym.envs import BUILTIN_ENVS, Env, EnvLoadError, UnknownEnvError, list_envs, make, register, unregister
from tracegym.envs import registry
from tracegym.environments.calculator import CalculatorEnv


def test_builtins_are_listed_without_importing_them() -> None:
    names = list_envs()
    for name in ("calculator", "frozenlake", "sokoban", "search", "service"):
        assert name in names
    assert names == sorted(names)
    assert BUILTIN_ENVS["search"] == "tracegym.environments.search:SearchEnv"


def test_make_returns_a_fresh_instance_each_call() -> None:
    a, b = make("calculator"), make("calculator")
    assert isinstance(a, CalculatorEnv) and a is not b
    assert a.results is not b.results


def test_make_passes_options() -> None:
    env = make("calculator", num_calls=3, max_turns=9)
    assert (env.min_calls, env.max_calls, env.max_turns) == (3, 3, 9)


def test_unknown_name_lists_registered_envs() -> None:
    with pytest.raises(UnknownEnvError) as info:
        make("calculater")
    message = str(info.value)
    assert "unknown env 'calculater'" in message
    assert "calculator, frozenlake" in message


def test_bad_option_names_it_and_the_allowed_ones() -> None:
    with pytest.raises(TypeError) as info:
        make("calculator", num_call=3)
    assert str(info.value) == "env 'calculator' has no option 'num_call'; allowed options: num_calls, max_turns, test_fraction"


def test_bad_option_value_names_the_env() -> None:
    with pytest.raises(ValueError, match=r"env 'calculator': num_calls must satisfy"):
        make("calculator", num_calls=0)


class Tiny(CalculatorEnv):
    name = "tiny"


def test_register_make_unregister() -> None:
    register("tiny-test", Tiny)
    try:
        assert "tiny-test" in list_envs()
        assert type(make("tiny-test")) is Tiny
        with pytest.raises(ValueError, match="already registered"):
            register("tiny-test", Tiny)
        register("tiny-test", lambda: Tiny(num_calls=2), overwrite=True)
        assert make("tiny-test").max_calls == 2
    finally:
        unregister("tiny-test")
    assert "tiny-test" not in list_envs()


def test_register_by_module_path_is_lazy() -> None:
    register("lazy-test", "tests_fake_env_module_xyz:Env")
    try:
        assert "lazy-test" in list_envs()  # listing does not import it
        with pytest.raises(EnvLoadError, match="cannot import 'tests_fake_env_module_xyz'"):
            make("lazy-test")
    finally:
        unregister("lazy-test")


def test_register_rejects_bad_factories() -> None:
    with pytest.raises(TypeError):
        register("x", 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        register("", Tiny)


def test_factory_returning_a_non_env_is_refused() -> None:
    register("not-env-test", lambda: object())
    try:
        with pytest.raises(TypeError, match="not a tracegym Env"):
            make("not-env-test")
    finally:
        unregister("not-env-test")


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, entries: dict[str, str]) -> None:
    fake = [importlib.metadata.EntryPoint(name=n, value=v, group=registry.ENTRY_POINT_GROUP) for n, v in entries.items()]

    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        return [ep for ep in fake if ep.group == group]

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)


def test_entry_point_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("fake_tracegym_plugin")

    class PluginEnv(CalculatorEnv):
        name = "plugin"

    module.PluginEnv = PluginEnv  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_tracegym_plugin", module)
    _fake_entry_points(monkeypatch, {"plugin-env": "fake_tracegym_plugin:PluginEnv", "broken-env": "fake_tracegym_plugin:Missing"})

    assert {"plugin-env", "broken-env"} <= set(list_envs())
    env = make("plugin-env", num_calls=2)
    assert isinstance(env, PluginEnv) and isinstance(env, Env) and env.max_calls == 2
    with pytest.raises(EnvLoadError, match="plugin entry point 'fake_tracegym_plugin:Missing' failed to load"):
        make("broken-env")
    # Built-ins take precedence over a plugin of the same name.
    _fake_entry_points(monkeypatch, {"calculator": "fake_tracegym_plugin:PluginEnv"})
    assert type(make("calculator")) is CalculatorEnv
