"""tracegym.plugins: user modules (--plugin / plugins:) and the tracegym.algos entry points."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import textwrap
from pathlib import Path

import pytest

from tracegym import plugins
from tracegym.envs import list_envs, make, unregister
from tracegym.plugins import PluginError, load_entry_points, load_plugins, resolve_plugin

ENV_MODULE = """
from tracegym.environments.calculator import CalculatorEnv
from tracegym.envs import register

IMPORTS = globals().get("IMPORTS", 0) + 1

class {cls}(CalculatorEnv):
    name = "{env}"
    description = "a calculator registered by a plain module"

register("{env}", {cls})
"""


@pytest.fixture()
def isolated(monkeypatch: pytest.MonkeyPatch):
    """sys.path as it was; this file's plugin modules (all named tgp_*) forgotten and the env names
    they registered removed afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    envs_before = set(list_envs())
    yield
    for name in [n for n in sys.modules if "tgp_" in n or n.startswith("tracegym_plugin_")]:
        del sys.modules[name]
    for name in set(list_envs()) - envs_before:
        unregister(name)


def _env_module(folder: Path, stem: str, env: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.py"
    path.write_text(ENV_MODULE.format(cls=stem.title().replace("_", ""), env=env))
    return path


def test_module_name_from_base_dir_registers_once(tmp_path: Path, isolated: None) -> None:
    _env_module(tmp_path / "cfg", "tgp_mod_a", "tgp-env-a")
    assert "tgp-env-a" not in list_envs()
    (module,) = load_plugins(["tgp_mod_a"], base_dir=tmp_path / "cfg")
    assert "tgp-env-a" in list_envs() and make("tgp-env-a").description.startswith("a calculator")
    again = load_plugins(["tgp_mod_a"], base_dir=tmp_path / "cfg")
    assert again == [module] and module.IMPORTS == 1  # a no-op, not a second import


def test_file_path_relative_to_base_dir_and_as_module_is_one_plugin(tmp_path: Path, isolated: None) -> None:
    path = _env_module(tmp_path / "plug", "tgp_mod_b", "tgp-env-b")
    (module,) = load_plugins(["plug/tgp_mod_b.py"], base_dir=tmp_path)
    assert "tgp-env-b" in list_envs() and module.__file__ == str(path)
    # the same file by absolute path, and by module name (its folder is now on sys.path)
    assert load_plugins([str(path), "tgp_mod_b"], base_dir=tmp_path / "elsewhere") == [module, module]
    assert module.IMPORTS == 1
    assert resolve_plugin("plug/tgp_mod_b.py", tmp_path) == str(path) and resolve_plugin("pkg.mod", tmp_path) == "pkg.mod"


def test_file_whose_stem_is_taken_gets_its_own_module(tmp_path: Path, isolated: None) -> None:
    path = _env_module(tmp_path, "json", "tgp-env-json")  # 'json' is the standard library's
    (module,) = load_plugins([str(path)])
    assert module is not sys.modules["json"] and "tgp-env-json" in list_envs()
    assert sys.modules[module.__name__] is module


def test_one_file_imported_as_a_file_and_as_a_package_module_registers_quietly(tmp_path: Path, isolated: None) -> None:
    pkg = tmp_path / "root" / "tgp_pkg_c"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    path = _env_module(pkg, "tgp_mod_c", "tgp-env-c")
    (as_file,) = load_plugins([str(path)])
    (as_package,) = load_plugins(["tgp_pkg_c.tgp_mod_c"], base_dir=tmp_path / "root")
    assert as_file is not as_package and as_package.__name__ == "tgp_pkg_c.tgp_mod_c"
    assert type(make("tgp-env-c")) is as_package.TgpModC  # the same definition, registered again
    # a different file that registers the same name is a clash, named in one line
    _env_module(tmp_path / "other", "tgp_mod_c2", "tgp-env-c")
    with pytest.raises(PluginError, match=r"plugin 'tgp_mod_c2': importing it failed: ValueError: env 'tgp-env-c' is "
                                          r"already registered"):
        load_plugins(["tgp_mod_c2"], base_dir=tmp_path / "other")
    assert "tgp_mod_c2" not in sys.modules


@pytest.mark.parametrize(
    "item, source, expected",
    [
        ("tgp_missing_mod", None, "plugin 'tgp_missing_mod': no module named 'tgp_missing_mod'"),
        ("nowhere/x.py", None, "plugin 'nowhere/x.py': no such file"),
        ("tgp_boom.py", "import os\n\nraise RuntimeError('boom')\n", "RuntimeError: boom (at "),
        ("tgp_dep.py", "import tgp_not_installed_dep\n", "ModuleNotFoundError: No module named 'tgp_not_installed_dep'"),
        ("tgp_syntax.py", "def broken(:\n", "SyntaxError"),
        ("not a module", None, "not a module name"),
    ],
)
def test_errors_are_one_line_naming_the_plugin(tmp_path: Path, isolated: None, item: str, source: str | None,
                                               expected: str) -> None:
    if source is not None:
        (tmp_path / item).write_text(source)
    with pytest.raises(PluginError) as info:
        load_plugins([item], base_dir=tmp_path)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and message.startswith(f"plugin {item!r}") and expected in message
    assert "\n" not in message.strip()
    if item == "tgp_boom.py":
        assert f"{tmp_path / 'tgp_boom.py'}:3)" in message  # the line that raised
    assert not any(name.startswith(("tgp_boom", "tgp_dep", "tgp_syntax")) for name in sys.modules)


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, entries: dict[str, str]) -> None:
    fake = [importlib.metadata.EntryPoint(name=n, value=v, group="tracegym.algos") for n, v in entries.items()]
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points",
                        lambda *, group: [ep for ep in fake if ep.group == group])


def test_entry_points_of_tracegym_algos_are_imported_once(tmp_path: Path, isolated: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tracegym.algos import ADVANTAGE_ESTIMATORS

    (tmp_path / "tgp_algos_ep.py").write_text(textwrap.dedent("""
        from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
        IMPORTS = globals().get("IMPORTS", 0) + 1

        @ADVANTAGE_ESTIMATORS.register("tgp_ep_estimator")
        def tgp_ep_estimator(groups, *, scale: float = 1.0):
            return groups
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, {"tgp": "tgp_algos_ep"})
    try:
        (module,) = load_entry_points()
        assert "tgp_ep_estimator" in ADVANTAGE_ESTIMATORS
        assert load_entry_points() == [module] and module.IMPORTS == 1
        _fake_entry_points(monkeypatch, {"tgp": "tgp_algos_ep", "broken": "tgp_algos_missing"})
        with pytest.raises(PluginError, match=r"plugin entry point 'broken' = 'tgp_algos_missing' \(group "
                                              r"'tracegym.algos'\): importing it failed: ModuleNotFoundError"):
            load_entry_points()
    finally:
        ADVANTAGE_ESTIMATORS.unregister("tgp_ep_estimator")


# --- load_for_command: plugins are imported before the config is validated -----------------------


def _args(config: Path, *overrides: str, plugin: tuple[str, ...] = ()) -> argparse.Namespace:
    return argparse.Namespace(config=str(config), overrides=list(overrides), plugin=list(plugin), print_config=False)


def _rl_config(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rl.yaml"
    path.write_text("model: {name: tiny-random}\n" + body)
    return path


def test_config_plugins_relative_to_the_config_file(tmp_path: Path, isolated: None, capsys) -> None:
    from tracegym.commands._config import load_for_command
    from tracegym.commands.rl import check_config
    from tracegym.config import RLConfig

    _env_module(tmp_path / "cfg" / "plug", "tgp_mod_d", "tgp-env-d")
    config = _rl_config(tmp_path / "cfg", "env: {name: tgp-env-d, options: {num_calls: 1}}\n")
    # without the plugin, the env name is rejected at config-check time, naming the key
    assert load_for_command(RLConfig, _args(config), check=check_config) == 2
    assert "bad value for 'env.name': unknown env 'tgp-env-d'" in capsys.readouterr().err
    config.write_text(config.read_text() + "plugins: [plug/tgp_mod_d.py]\n")
    cfg = load_for_command(RLConfig, _args(config), check=check_config)
    assert cfg.env.name == "tgp-env-d"
    assert cfg.plugins == [str((tmp_path / "cfg" / "plug" / "tgp_mod_d.py").resolve())]  # recorded, absolute


def test_override_and_flag_plugins_are_loaded_and_recorded(tmp_path: Path, isolated: None, monkeypatch) -> None:
    from tracegym.commands._config import load_for_command
    from tracegym.commands.rl import check_config
    from tracegym.config import RLConfig

    monkeypatch.chdir(tmp_path)
    _env_module(tmp_path / "p", "tgp_mod_e", "tgp-env-e")
    _env_module(tmp_path, "tgp_mod_f", "tgp-env-f")
    config = _rl_config(tmp_path / "cfg", "plugins: [does_not_exist.py]\nenv: {name: tgp-env-e}\n")
    # plugins=[...] replaces the file's list (relative to the current directory); --plugin adds
    cfg = load_for_command(RLConfig, _args(config, "plugins=[p/tgp_mod_e.py]", plugin=("tgp_mod_f",)),
                           check=check_config)
    assert not isinstance(cfg, int)
    assert cfg.plugins == [str(tmp_path / "p" / "tgp_mod_e.py"), "tgp_mod_f"]
    assert {"tgp-env-e", "tgp-env-f"} <= set(list_envs())


def test_a_broken_config_plugin_is_one_error_line(tmp_path: Path, isolated: None, capsys) -> None:
    from tracegym.commands._config import load_for_command
    from tracegym.config import RLConfig

    config = _rl_config(tmp_path, "plugins: [tgp_broken.py]\n")
    (tmp_path / "tgp_broken.py").write_text("x = 1\nundefined_name\n")
    assert load_for_command(RLConfig, _args(config)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: plugin 'tgp_broken.py': importing ") and "NameError" in err
    assert f"tgp_broken.py:2)" in err and len(err.splitlines()) == 1
