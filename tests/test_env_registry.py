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
    for name in ("calculator", "code", "frozenlake", "sokoban", "search", "service", "terminal"):
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
    assert "unknown env 'calculater'; did you mean 'calculator'?" in message
    assert "calc_relay, calculator, code, frozenlake, logic_grid" in message and "--plugin" in message
    with pytest.raises(UnknownEnvError, match=r"unknown env 'zzz'; registered envs: calc_proposer, calc_relay, calculator"):
        make("zzz")  # nothing near: no guess


def test_bad_option_names_it_and_the_allowed_ones() -> None:
    with pytest.raises(TypeError) as info:
        make("calculator", num_call=3)
    assert isinstance(info.value, ValueError)  # EnvOptionError: a bad keyword and a bad config value
    assert str(info.value) == ("env 'calculator' has no option 'num_call' (did you mean 'num_calls'?); "
                               "allowed options: num_calls, max_turns, test_fraction, max_tool_output_chars, reward_parts")


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
        register("tiny-test", Tiny)  # the same factory again (a module imported twice): fine
        with pytest.raises(ValueError, match="already registered"):
            register("tiny-test", CalculatorEnv)
        register("tiny-test", lambda: Tiny(num_calls=2), overwrite=True)
        with pytest.raises(ValueError, match="already registered"):
            register("tiny-test", lambda: Tiny(num_calls=3))  # another lambda is another factory
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


def test_same_definition_from_another_module_object_registers_quietly(tmp_path, monkeypatch) -> None:
    import importlib.util

    source = tmp_path / "twice_env.py"
    source.write_text("from tracegym.environments.calculator import CalculatorEnv\n\n"
                      "class TwiceEnv(CalculatorEnv):\n    name = 'twice'\n")
    classes = []
    for module_name in ("twice_env_a", "twice_env_b"):  # one file, two module objects
        spec = importlib.util.spec_from_file_location(module_name, source)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, module_name, module)
        spec.loader.exec_module(module)
        classes.append(module.TwiceEnv)
    assert classes[0] is not classes[1]
    try:
        register("twice-test", classes[0])
        register("twice-test", classes[1])
        assert type(make("twice-test")) is classes[1]
        register("twice-test", "tests_some_module:TwiceEnv", overwrite=True)
        register("twice-test", "tests_some_module:TwiceEnv")  # the same path string
        with pytest.raises(ValueError, match="already registered"):
            register("twice-test", "tests_other_module:TwiceEnv")
    finally:
        unregister("twice-test")


# --- check_env_options: name and options from the signature, nothing built ----------------------


def test_check_env_options_accepts_good_options_without_building(monkeypatch: pytest.MonkeyPatch) -> None:
    from tracegym.envs.registry import check_env_options

    def never(*args, **kwargs):
        raise AssertionError("check_env_options built the env")

    monkeypatch.setattr(CalculatorEnv, "__init__", never)
    check_env_options("calculator", {"num_calls": [1, 2], "max_turns": 6})
    check_env_options("calculator", {"num_calls": "1-3", "test_fraction": 0.5})
    check_env_options("calculator")


@pytest.mark.parametrize(
    "name, options, error, message",
    [
        ("calculater", {}, UnknownEnvError, "unknown env 'calculater'; did you mean 'calculator'?"),
        ("calculator", {"num_call": 3}, TypeError,
         "env 'calculator' has no option 'num_call' (did you mean 'num_calls'?); allowed options: num_calls, max_turns, "
         "test_fraction"),
        ("sokoban", {"size": "big"}, ValueError,
         "env 'sokoban': bad value for option 'size'='big': Input should be a valid integer"),
        ("calculator", {"test_fraction": [0.2]}, ValueError,
         "env 'calculator': bad value for option 'test_fraction'=[0.2]: Input should be a valid number"),
        ("needs-test", {}, TypeError, "env 'needs-test' needs option 'level'"),
    ],
)
def test_check_env_options_rejects_with_one_line(name: str, options: dict, error: type, message: str) -> None:
    from tracegym.envs.registry import EnvOptionError, check_env_options

    def needs_level(level: int, *, hard: bool = False) -> Env:
        return Tiny()

    register("needs-test", needs_level)
    try:
        with pytest.raises(error) as info:
            check_env_options(name, options)
    finally:
        unregister("needs-test")
    assert message in str(info.value) and "\n" not in str(info.value)
    if error is not UnknownEnvError:
        assert isinstance(info.value, EnvOptionError)


def test_check_env_options_skips_what_it_cannot_read() -> None:
    from tracegym.envs.registry import check_env_options

    class Anything:  # not a type pydantic knows: no value check, the name is still checked
        pass

    def with_kwargs(**options) -> Env:
        return Tiny()

    def with_custom(thing: Anything = None, level: "NotDefinedAnywhere" = 1) -> Env:  # noqa: F821
        return Tiny()

    register("kwargs-test", with_kwargs)
    register("custom-test", with_custom)
    try:
        check_env_options("kwargs-test", {"whatever": 1})
        check_env_options("custom-test", {"thing": 3, "level": "x"})
        with pytest.raises(TypeError, match="has no option 'other'"):
            check_env_options("custom-test", {"other": 1})
    finally:
        unregister("kwargs-test")
        unregister("custom-test")
