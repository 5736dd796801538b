"""Run configs: unknown keys and bad values give errors that say what to write instead."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

from tracegym.config import (
    ConfigError,
    DistillConfig,
    DPOConfig,
    LoraConfig,
    RLConfig,
    SFTConfig,
    SynthesizeConfig,
    apply_overrides,
    describe_fields,
    dump_config,
    load_config,
    parse_overrides,
)

import tracegym.algos  # noqa: F401  (fills the registries)
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS, PREFERENCE_LOSSES
from tracegym.envs.registry import BUILTIN_ENVS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_unknown_key_names_location_nearest_key_and_allowed_keys(tmp_path):
    path = _write(tmp_path, "model:\n  name: tiny-random\nlora:\n  enabled: true\n  rnak: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, path)
    (problem,) = info.value.problems
    assert "unknown key 'lora.rnak'" in problem
    assert f"{path}:5" in problem  # the line of the bad key
    assert "did you mean 'lora.r'?" in problem
    assert "allowed keys here: alpha, dropout, enabled, r, target_modules" in problem


def test_unknown_top_level_key_suggests_nearest(tmp_path):
    path = _write(tmp_path, "micro_batchsize: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, path)
    assert "did you mean 'micro_batch_size'?" in str(info.value)
    assert f"{path}:1" in str(info.value)


def test_unknown_key_lists_all_keys_of_its_section():
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, data={"optim": {"learning_rate": 1}})
    (problem,) = info.value.problems
    assert "did you mean 'optim." in problem
    assert "allowed keys here: betas, eps, lr, max_grad_norm, schedule, warmup_steps, weight_decay" in problem


def test_bad_literal_names_key_and_allowed_values(tmp_path):
    path = _write(tmp_path, "optim:\n  schedule: cosin\n")
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, path)
    (problem,) = info.value.problems
    assert "'optim.schedule'" in problem and f"{path}:2" in problem
    assert "'constant', 'linear' or 'cosine'" in problem
    assert "got 'cosin'" in problem


def test_union_field_errors_are_merged_into_one_message():
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, data={"lora": {"target_modules": 5}})
    (problem,) = info.value.problems
    assert problem.startswith("bad value for 'lora.target_modules'")
    assert "'all-linear'" in problem and "got 5" in problem


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, data={"optim": {"lrr": 1, "schedule": "x"}, "batch_size": -1})
    assert len(info.value.problems) == 3


def test_cross_field_rule_batch_multiple_of_micro_batch():
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        load_config(SFTConfig, data={"batch_size": 8, "micro_batch_size": 3})


def test_overrides_are_yaml_parsed_and_nested(tmp_path):
    path = _write(tmp_path, "lora:\n  r: 16\noptim:\n  lr: 2.0e-4\n")
    cfg = load_config(
        SFTConfig,
        path,
        ["lora.r=8", "optim.lr=1e-4", "lora.enabled=false", "data.train_files=[a.jsonl, b.jsonl]",
         "optim.max_grad_norm=null", "model.name='123'"],
    )
    assert cfg.lora.r == 8 and isinstance(cfg.lora.r, int)
    assert cfg.optim.lr == 1e-4  # YAML 1.1 would read 1e-4 as a string
    assert cfg.lora.enabled is False
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.optim.max_grad_norm is None
    assert cfg.model.name == "123"  # quoted: stays a string


def test_override_of_unknown_key_names_the_command_line():
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, data={}, overrides=["optim.betass=[0.9, 0.95]"])
    (problem,) = info.value.problems
    assert "command line 'optim.betass=[0.9, 0.95]'" in problem
    assert "did you mean 'optim.betas'?" in problem


@pytest.mark.parametrize("bad", ["lora.r", "=3", "lora..r=3", "lora.r=[1"])
def test_malformed_overrides_are_rejected(bad):
    with pytest.raises(ConfigError):
        parse_overrides([bad])


def test_override_into_a_value_is_rejected():
    with pytest.raises(ConfigError, match="is a value"):
        apply_overrides({"seed": 3}, ["seed.x=1"])


def test_apply_overrides_does_not_mutate_input():
    data = {"lora": {"r": 4}}
    out = apply_overrides(data, ["lora.r=8"])
    assert data == {"lora": {"r": 4}} and out == {"lora": {"r": 8}}


def test_float_resolution_of_yaml_files(tmp_path):
    path = _write(tmp_path, "optim:\n  lr: 3e-5\n  eps: 1E-6\n")
    cfg = load_config(SFTConfig, path)
    assert cfg.optim.lr == 3e-5 and cfg.optim.eps == 1e-6


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(SFTConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(SFTConfig, _write(tmp_path, "- 1\n- 2\n"))


def test_dump_round_trips(tmp_path):
    cfg = load_config(SFTConfig, data={}, overrides=["lora.r=4", "optim.schedule=cosine", "optim.betas=[0.9, 0.95]"])
    path = dump_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    again = load_config(SFTConfig, path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["lora"]["r"] == 4


@pytest.mark.parametrize("cls", [SFTConfig, RLConfig, DPOConfig, DistillConfig, SynthesizeConfig])
def test_every_field_has_a_description(cls):
    rows = describe_fields(cls)
    undocumented = [key for key, _, _, description in rows if not description.strip()]
    assert not undocumented
    assert len(rows) > 30


def test_lora_defaults_target_all_linear_layers():
    assert LoraConfig().target_modules == "all-linear"


def _import(path: str):
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def test_every_example_config_loads():
    files = sorted(EXAMPLES.glob("*.yaml"))
    names = {f.name for f in files}
    for env in ("calculator", "search", "gridworld", "service"):
        assert f"sft_{env}.yaml" in names and f"rl_{env}.yaml" in names
    from tracegym.recipes.demo import DemoConfig  # tracegym demo --config examples/demo_*.yaml

    classes = {"sft": SFTConfig, "rl": RLConfig, "dpo": DPOConfig, "distill": DistillConfig,
               "synthesize": SynthesizeConfig, "demo": DemoConfig}
    for file in files:
        prefix = file.name.split("_", 1)[0]
        assert prefix in classes, file.name
        cls = classes[prefix]
        cfg = load_config(cls, file)
        assert isinstance(cfg, cls)
        if isinstance(cfg, DPOConfig):
            assert cfg.loss.name in PREFERENCE_LOSSES, cfg.loss.name
        if isinstance(cfg, RLConfig):
            assert cfg.env.name in BUILTIN_ENVS, f"{file.name}: unknown env {cfg.env.name!r}"
            env_class = _import(BUILTIN_ENVS[cfg.env.name])
            params = inspect.signature(env_class.__init__).parameters
            unknown = set(cfg.env.options) - set(params)
            assert not unknown, f"{file.name}: {cfg.env.name} takes no option(s) {unknown}"
            PolicyLossConfig.model_validate(cfg.policy_loss)  # the dict is valid for the losses
            assert cfg.advantage.estimator in ADVANTAGE_ESTIMATORS, cfg.advantage.estimator


@pytest.mark.parametrize("cls", [SFTConfig, RLConfig, DPOConfig, DistillConfig, SynthesizeConfig])
def test_docs_describe_every_key(cls):
    docs = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = [key for key, kind, _, _ in describe_fields(cls) if kind != "section" and f"`{key}`" not in docs]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_rl_rollout_section_maps_onto_the_rollout_runner_config():
    from tracegym.rollout import RolloutConfig

    cfg = load_config(RLConfig, EXAMPLES / "rl_calculator.yaml")
    runner_cfg = RolloutConfig(
        **cfg.rollout.settings(),
        samples_per_task=cfg.group_size,
        seed=cfg.seed,
    )
    assert runner_cfg.max_turns == cfg.rollout.max_turns and runner_cfg.samples_per_task == cfg.group_size
