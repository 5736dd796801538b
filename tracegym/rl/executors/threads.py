"""``executor.kind: threads``: a rollout thread samples the next batches while the trainer updates.

The thread owns a copy of the policy (its own weights; the trainer's keep changing under the
optimizer) and its own hf engine. Before each batch it takes the newest weights the trainer
published, so batch ``i`` is sampled by whatever version was newest when it started. The
staleness gate lets batch ``i`` start only while ``i <= max_staleness + trainer_version``, so it
is trained at most ``max_staleness`` versions after the weights that sampled it. With
``max_staleness: 0`` a batch starts only once the update before it is published: the thread and
the trainer take turns and every batch equals the ``local`` executor's (tested).

One process, two Python threads: torch releases the GIL inside its kernels, so sampling and the
update overlap on separate cores. torch's thread count is process-wide, so it is set to half the
CPUs: two OpenMP teams of all cores each would oversubscribe 2 cores and slow both 10-20x.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from typing import Any, Sequence

import torch

from tracegym.rl.executors.base import (Executor, ExecutorStats, ParamStore, RolloutBatch, lag_metrics,
                                     load_trainable_state, sample_batch, trainable_state)
from tracegym.rl.executors.gate import StalenessGate


class ThreadsExecutor(Executor):
    kind = "threads"

    def __init__(self, cfg: Any, model: torch.nn.Module, tokenizer: Any, renderer: Any,
                 train_tasks: Sequence[Any], version: int) -> None:
        from tracegym.rl.policy import make_sampler

        self.cfg, self.renderer, self.train_tasks = cfg, renderer, list(train_tasks)
        threads = cfg.executor.trainer_threads or max(1, (os.cpu_count() or 2) // 2)
        self._threads_before = torch.get_num_threads()  # process-wide: restored by close()
        torch.set_num_threads(threads)
        self.sampler_model = copy.deepcopy(model).eval()  # [the policy]: weights of the newest published version
        self.sampler = make_sampler(cfg, self.sampler_model, tokenizer, renderer)
        self.store = ParamStore(trainable_state(model), version)
        self.gate = StalenessGate(batch_size=1, max_staleness=cfg.executor.max_staleness)
        self.gate.on_update(version)
        self.gate.skip_to(version)  # batches before ``version`` were trained before a resume
        self.stats = ExecutorStats()
        self._cond = threading.Condition()
        self._ready: dict[int, RolloutBatch] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._trainer_version = version
        self._next_index = version
        self._busy_s = 0.0  # time the thread spent sampling
        self._idle_s = 0.0  # time it waited on the staleness gate (the trainer was behind)
        self._thread = threading.Thread(target=self._run, name="tracegym-rollouts", daemon=True)
        self._thread.start()

    # -- the rollout thread --

    def _run(self) -> None:
        loaded = self.store.version
        try:
            while True:
                with self._cond:
                    # Wait for the gate, and never sample past the last step.
                    idle_from = time.perf_counter()
                    while not self._stop and (not self.gate.can_start() or self._next_index >= self.cfg.steps):
                        self._cond.wait(0.5)
                    self._idle_s += time.perf_counter() - idle_from
                    if self._stop:
                        return
                    self.gate.start()
                    index = self._next_index
                    self._next_index += 1
                newer = self.store.newer_than(loaded)
                if newer is not None:
                    state, loaded = newer
                    load_trainable_state(self.sampler_model, state)
                    self.sampler.update_weights(self.sampler_model)  # drops the engine's caches of old weights
                started = time.perf_counter()
                batch = sample_batch(self.sampler, self.cfg, self.renderer, self.train_tasks, index, loaded, "thread-0")
                with self._cond:
                    self._busy_s += time.perf_counter() - started
                    self.gate.finish()
                    self._ready[index] = batch
                    self._cond.notify_all()
        except BaseException as exc:  # the trainer re-raises it: a dead rollout thread must not hang the run
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    # -- the trainer's side --

    def next_batch(self, step: int, cursor: int, round_index: int) -> RolloutBatch:
        waited = time.perf_counter()
        deadline = waited + self.cfg.executor.batch_timeout_s
        with self._cond:
            while step not in self._ready:
                if self._error is not None:
                    raise RuntimeError(f"the rollout thread failed: {type(self._error).__name__}: {self._error}") from self._error
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"no rollouts for step {step + 1} after {self.cfg.executor.batch_timeout_s:g} s "
                                       "(executor.batch_timeout_s)")
                self._cond.wait(0.5)
            batch = self._ready.pop(step)
        self.stats.record_trained(batch, self._trainer_version, time.perf_counter() - waited)
        return batch

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self.store.put(trainable_state(model), version)
        with self._cond:
            self._trainer_version = version
            self.gate.on_update(version)
            self._cond.notify_all()

    def metrics(self) -> dict[str, float]:
        with self._cond:
            busy, self._busy_s = self._busy_s, 0.0
            idle, self._idle_s = self._idle_s, 0.0
        out = {**lag_metrics(self.stats), "async/rollout_busy_s": busy, "async/worker_idle_s": idle}
        self.stats.clear()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"gate": self.gate.state_dict(), "trainer_version": self._trainer_version}

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        torch.set_num_threads(self._threads_before)
