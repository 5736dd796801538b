"""bench/credit_assignment.py --start: each method's RL config from a demo run (no model is loaded).

The comparison is only fair when the methods differ in their credit assignment and nothing else:
the same SFT adapter, train tasks, learning rate, loss, trust region, replay and temperatures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from tracegym.recipes.demo import DemoConfig

_SPEC = importlib.util.spec_from_file_location(
    "credit_assignment", Path(__file__).resolve().parents[1] / "bench" / "credit_assignment.py")
credit_assignment = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(credit_assignment)


@pytest.fixture
def demo_run(tmp_path: Path) -> Path:
    """A finished demo run as far as the config is concerned: its saved config and an SFT adapter."""
    run = tmp_path / "demo"
    (run / "train_sft" / "final").mkdir(parents=True)
    (run / "train_sft" / "final" / "adapter_config.json").write_text("{}", encoding="utf-8")
    saved = DemoConfig(env_options={"num_calls": 3}, sft_env_options={"num_calls": 3}, rl_steps=99,
                       rl_estimator="gigpo").model_dump(mode="json")
    (run / "demo_config.json").write_text(json.dumps(saved), encoding="utf-8")
    return run


def _configs(demo_run: Path, tmp_path: Path, seed: int) -> dict:
    args = argparse.Namespace(start=demo_run, tree_leaves=8)
    saved = json.loads((demo_run / "demo_config.json").read_text(encoding="utf-8"))
    demo = DemoConfig(**{k: v for k, v in saved.items() if not k.startswith("rl_")}, rl_steps=5)
    return {method: credit_assignment.strong_start_run(args, demo, method, seed, tmp_path / method)
            for method in credit_assignment.METHODS}


def test_methods_differ_in_credit_assignment_only(demo_run: Path, tmp_path: Path):
    configs = _configs(demo_run, tmp_path, seed=1)
    assert {m: c.advantage.estimator for m, c in configs.items()} == {
        "grpo": "grpo", "turn_grpo": "turn_grpo", "gigpo": "gigpo", "tree": "tree"}
    assert configs["gigpo"].advantage.options == {"gamma": 1.0}
    grpo = configs["grpo"]
    assert grpo.model.adapter == str(demo_run / "train_sft" / "final")
    assert grpo.steps == 5  # the saved run's rl_* values are not reused (rl_steps 99, rl_estimator gigpo)
    assert grpo.rollout.strategy == "chains" and grpo.group_size == 6 and grpo.guidance is not None
    assert grpo.env.options["reward_parts"] == {"answer": 1.0, "calls": 0.3}  # turns carry rewards
    assert not grpo.health.mutual_information
    shared = ("optim", "policy_loss", "tasks", "expert_replay", "max_policy_drift", "env", "steps", "seed")
    for method, cfg in configs.items():
        for key in shared:
            assert getattr(cfg, key) == getattr(grpo, key), (method, key)
        assert cfg.rollout.temperature == grpo.rollout.temperature == 0.7
        assert cfg.output_dir == str(tmp_path / method)
    tree = configs["tree"]
    assert tree.rollout.strategy == "tree" and tree.rollout.tree.branch == "entropy"
    assert tree.group_size == 8 and tree.guidance is None  # guidance joins groups of chains only


def test_every_seed_trains_on_the_same_tasks(demo_run: Path, tmp_path: Path):
    zero, three = _configs(demo_run, tmp_path, seed=0)["grpo"], _configs(demo_run, tmp_path, seed=3)["grpo"]
    assert (zero.seed, three.seed) == (0, 3)
    assert zero.tasks == three.tasks and zero.tasks.seed == DemoConfig().seed
