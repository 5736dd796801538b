"""A loss and an estimator written outside the package, used by ``tracegym rl`` through ``--plugin``
and through the config's ``plugins:`` key, from a user's own folder (a subprocess, as a user runs it).

The loss is the CISPO example of docs/algorithms.md (examples/plugins/cispo_loss.py, copied into the
temp folder); the estimator is the docs' ``best_vs_rest``. The run must train with them: the
estimator's values reach the tokens (its margin shows in the logged loss scale), the loss's own
metric is logged, and its option is validated like any other config key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFIG = """
model: {{name: tiny-random}}
lora: {{r: 4}}
env: {{name: calculator, options: {{num_calls: 1}}}}
tasks: {{train: 4, test: 1}}
tasks_per_step: 2
group_size: 3
rollout: {{max_turns: 1, max_tokens_per_turn: 4, concurrency: 8}}
steps: 1
eval: {{at_start: false, every: 0}}
skip_uniform_groups: false
save_rollouts: false
output_dir: {out}
logging: {{progress: false, tensorboard: false}}
{extra}
"""


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "tracegym", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _setup(tmp_path: Path, extra: str = "") -> Path:
    shutil.copy(REPO / "examples" / "plugins" / "cispo_loss.py", tmp_path / "my_loss.py")
    shutil.copy(REPO / "examples" / "plugins" / "best_vs_rest.py", tmp_path / "my_estimator.py")
    (tmp_path / "cfg.yaml").write_text(CONFIG.format(out=tmp_path / "run", extra=extra))
    return tmp_path / "cfg.yaml"


def _last_row(run: Path) -> dict:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]


def test_rl_trains_with_a_plugin_loss_and_estimator_from_the_users_folder(tmp_path):
    _setup(tmp_path)
    done = _run(tmp_path, "rl", "--plugin", "my_loss", "--plugin", "my_estimator", "--config", "cfg.yaml",
                "policy_loss.loss=my_cispo", "policy_loss.eps_high=0.3", "advantage.estimator=best_vs_rest",
                "advantage.options.margin=0.5")
    assert done.returncode == 0, done.stderr[-3000:]
    row = _last_row(tmp_path / "run")
    assert row["step"] == 1 and row["examples/count"] == 6.0 and row["groups/no_signal"] == 0.0
    assert "train/clip_frac_high" in row and "train/ratio_mean" in row  # the loss's own metrics are logged
    assert row["train/grad_norm"] > 0  # best_vs_rest gives non-zero advantages even at reward 0
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "my_cispo" in saved and "best_vs_rest" in saved


def test_plugins_key_in_the_config_and_option_errors(tmp_path):
    _setup(tmp_path, "plugins: [my_loss.py, my_estimator.py]\npolicy_loss: {loss: my_cispo}\n"
                     "advantage: {estimator: best_vs_rest}")
    done = _run(tmp_path, "rl", "--config", "cfg.yaml", "--print-config")
    assert done.returncode == 0, done.stderr[-3000:]
    # the plugin's options are validated like any config key, with the nearest valid one
    bad = _run(tmp_path, "rl", "--config", "cfg.yaml", "policy_loss.eps_hgh=0.3", "advantage.options.margn=1")
    assert bad.returncode == 2
    assert "eps_hgh" in bad.stderr and "eps_high" in bad.stderr, bad.stderr
    assert "margn" in bad.stderr and "margin" in bad.stderr, bad.stderr
    assert not (tmp_path / "run").exists()
    # without the plugin the names are unknown, said in one line before anything loads
    (tmp_path / "cfg.yaml").write_text((tmp_path / "cfg.yaml").read_text().replace("plugins: [my_loss.py, my_estimator.py]", ""))
    missing = _run(tmp_path, "rl", "--config", "cfg.yaml")
    assert missing.returncode == 2 and "my_cispo" in missing.stderr and "--plugin" in missing.stderr, missing.stderr
