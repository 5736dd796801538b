"""Executors: ``threads`` with staleness 0 is the ``local`` run exactly; with staleness 1 batches are
sampled ahead and never trained more than one version late; ``ray`` runs two CPU rollout actors
that learn an easy task within the staleness bound, and survives a worker killed mid-run.

The envs live in a plugin file written per test, so that Ray's worker processes import them too.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tracegym.config import RLConfig, load_config
from tracegym.rl.executors.base import VERSION_KEY
from tracegym.plugins import load_plugins
from tracegym.recipes.rl import train_rl
from tracegym.train.logging import read_metrics

NON_DETERMINISTIC = ("time", "rss_mb", "time/", "rollout/tokens_per_s", "train/tokens_per_s", "async/")

PLUGIN = textwrap.dedent('''
    """Test envs for the executor tests (imported by the trainer and by every Ray worker)."""
    import os
    import signal
    import time

    from tracegym.envs import register
    from tracegym.envs.base import Env, Task
    from tracegym.types import Message, StepResult


    class LetterEnv(Env):
        """Reward 1 when the reply contains ``letter`` (a random model's 1-token reply: about half)."""

        name = "exec-letter"

        def __init__(self, letter: str = "e", kill_once_file: str | None = None, stall_once_file: str | None = None):
            self.letter, self.kill_once_file, self.stall_once_file = letter, kill_once_file, stall_once_file

        def _first_time(self, path):
            """True once per path across every process (an atomic create)."""
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return True
            except FileExistsError:
                return False

        def tasks(self, split="train", n=100, seed=0):
            offset = 0 if split == "train" else 10_000
            return [Task(id=f"{split}-{seed}-{i}", split=split, data={"word": f"w{offset + i}"}) for i in range(n)]

        def tool_schemas(self):
            return []

        async def reset(self, task):
            return [Message(role="system", content="Reply with one word."),
                    Message(role="user", content=f"Word {task.data['word']}")]

        async def step(self, message, parse_errors=()):
            # Fault injection, in Ray workers only: the first episode to get here kills its worker's
            # process, or hangs it (a blocking sleep stalls the worker's whole event loop).
            if os.environ.get("TRACEGYM_IN_RAY_WORKER") == "1":
                if self.kill_once_file and self._first_time(self.kill_once_file):
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.stall_once_file and self._first_time(self.stall_once_file):
                    time.sleep(120)
            ok = self.letter in message.content
            return StepResult(reward=float(ok), terminated=True, info={"success": ok})

        def expert_action(self):
            return Message(role="assistant", content=self.letter)


    register("exec-letter", LetterEnv, overwrite=True)
''')


@pytest.fixture
def plugin(tmp_path) -> str:
    path = tmp_path / "exec_envs.py"
    path.write_text(PLUGIN)
    load_plugins([str(path)])  # as the CLI does for the config's plugins; Ray workers load them themselves
    return str(path)


def _config(out: Path, plugin: str, *overrides: str) -> RLConfig:
    data = {
        "plugins": [plugin],
        "model": {"name": "tiny-random"},
        "lora": {"enabled": True, "r": 4},
        "optim": {"lr": 1e-3},
        "env": {"name": "exec-letter", "options": {"letter": "m"}},
        "tasks": {"train": 8, "test": 0, "seed": 0},
        "tasks_per_step": 2,
        "group_size": 4,
        "rollout": {"max_turns": 1, "max_tokens_per_turn": 3, "concurrency": 8},
        "micro_batch_size": 4,
        "steps": 3,
        "eval": {"every": 0, "at_start": False},
        "output_dir": str(out),
        "logging": {"progress": False, "tensorboard": False},
    }
    return load_config(RLConfig, data=data, overrides=list(overrides))


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if not k.startswith(NON_DETERMINISTIC)}
            for row in read_metrics(run_dir) if row["step"] > 0]


def _versions(run_dir: Path) -> list[set[int]]:
    """Per step, the policy versions recorded on the saved rollouts."""
    out = []
    for path in sorted((run_dir / "rollouts").glob("step_*.jsonl")):
        out.append({json.loads(line)["info"][VERSION_KEY] for line in path.read_text().splitlines()})
    return out


def test_threads_with_staleness_zero_is_the_local_run_exactly(tmp_path, plugin):
    # The same torch thread count on both sides: float sums in another order differ in the last bits.
    same_threads = f"executor.trainer_threads={torch.get_num_threads()}"
    local = train_rl(_config(tmp_path / "local", plugin))
    threads = train_rl(_config(tmp_path / "threads", plugin, "executor.kind=threads", "executor.max_staleness=0",
                               same_threads))
    assert torch.get_num_threads() == int(same_threads.split("=")[1])  # restored after the run
    assert _rows(threads.run_dir) == _rows(local.run_dir)
    assert _versions(local.run_dir) == _versions(threads.run_dir) == [{0}, {1}, {2}]
    final = {row["step"]: row for row in read_metrics(threads.run_dir)}
    assert all(final[s]["async/lag_max"] == 0 for s in (1, 2, 3))


def test_threads_sample_ahead_within_the_staleness_bound(tmp_path, plugin):
    result = train_rl(_config(tmp_path / "run", plugin, "executor.kind=threads", "executor.max_staleness=1", "steps=4"))
    versions = _versions(result.run_dir)
    assert len(versions) == 4 and all(len(v) == 1 for v in versions)
    lags = [step - next(iter(v)) for step, v in enumerate(versions)]
    assert all(0 <= lag <= 1 for lag in lags), lags
    assert 1 in lags, f"nothing was sampled ahead: {lags}"  # batch 1 starts while batch 0 trains
    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert max(r["async/lag_max"] for r in rows) <= 1
    # the rollout thread sampled during the run and waited on the gate only while the trainer was behind
    assert sum(r["async/rollout_busy_s"] for r in rows) > 0 and all(r["async/worker_idle_s"] >= 0 for r in rows)


def test_async_executors_refuse_steps_that_need_the_local_sampler(tmp_path, plugin):
    with pytest.raises(Exception, match="resample_rounds needs executor.kind: local"):
        _config(tmp_path / "x", plugin, "executor.kind=threads", "resample_rounds=1")
    with pytest.raises(Exception, match="need executor.kind: local"):
        _config(tmp_path / "x", plugin, "executor.kind=ray", "rollout.strategy=tree")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="ray is a dependency (requirements.txt); install it")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TRACEGYM_IN_RAY_WORKER": "1", "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def test_ray_workers_learn_an_easy_task_within_the_staleness_bound(tmp_path, plugin, ray_cluster):
    cfg = _config(tmp_path / "run", plugin, "executor.kind=ray", "executor.rollout_workers=2", "executor.max_staleness=1",
                  "executor.worker_cpus=1", "lora.enabled=false", "optim.lr=0.1", "env.options.letter=e",
                  "rollout.max_tokens_per_turn=1", "group_size=16", "tasks.train=16", "steps=12")
    result = train_rl(cfg)
    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    rewards = [r["reward/mean"] for r in rows]
    assert len(rows) == 12 and all(r["async/lag_max"] <= 1 for r in rows)
    versions = _versions(result.run_dir)
    assert all(0 <= step - v <= 1 for step, vs in enumerate(versions) for v in vs), versions
    assert 0.2 < rewards[0] < 0.8 and sum(rewards[-3:]) / 3 >= 0.85, rewards


def test_a_killed_ray_worker_loses_only_its_batch(tmp_path, plugin, ray_cluster):
    marker = tmp_path / "killed-once"
    cfg = _config(tmp_path / "run", plugin, "executor.kind=ray", "executor.rollout_workers=2", "executor.max_staleness=1",
                  f"env.options.kill_once_file={marker}", "steps=3")
    result = train_rl(cfg)
    assert marker.exists(), "the fault was never injected"
    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert len(rows) == 3 and result.final_dir is not None
    assert sum(r["async/worker_failures"] for r in rows) == 1
    assert sum(r["async/dropped_episodes"] for r in rows) == 2 * 4  # tasks_per_step x group_size
    # every step still trained on a whole batch: the lost one was sampled again
    assert [len(p.read_text().splitlines()) for p in sorted((result.run_dir / "rollouts").glob("step_*.jsonl"))] == [8, 8, 8]


def test_a_stalled_ray_worker_is_replaced_and_never_stalls_the_trainer(tmp_path, plugin, ray_cluster):
    marker = tmp_path / "stalled-once"
    # A batch here takes a worker under 1 s, also with the machine loaded (0.4-0.9 s measured with
    # two busy processes beside the run): 5 s is a stall, and the run waits 5 s for it, not 10.
    cfg = _config(tmp_path / "run", plugin, "executor.kind=ray", "executor.rollout_workers=2", "executor.max_staleness=1",
                  "executor.batch_timeout_s=5", f"env.options.stall_once_file={marker}", "steps=3")
    result = train_rl(cfg)
    assert marker.exists(), "the stall was never injected"
    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert len(rows) == 3 and sum(r["async/worker_failures"] for r in rows) == 1
    assert max(r["time/step_s"] for r in rows) < 60  # the 120 s hang was cut at the 5 s batch timeout
