"""``executor.kind: ray``: rollout workers as Ray actors, the trainer in the driver.

    executor: {kind: ray, rollout_workers: 4, worker_cpus: 1, max_staleness: 1}
    executor: {kind: ray, ray_address: "ray://head:10001"}      # an existing cluster

Each :class:`RolloutWorker` actor builds its own policy, hf engine and envs from the run's config
(the same code path as the trainer's) and sets its torch/OpenMP threads from its CPU share. The
trainer publishes the weights an update changed (the LoRA adapter, or all weights with full
fine-tuning) with ``ray.put`` once per version; a worker loads them only when a batch is sent to it
with a newer version than it holds (Ray's object store is the parameter store: one copy per node,
shared by its workers).

Scheduling: batch ``i`` (step ``i``'s tasks and seed) is sent to an idle worker only while the
staleness gate admits it (``i <= max_staleness + trainer_version``), so it is trained at most
``max_staleness`` versions after the weights that sampled it. Batches may finish out of order; the
trainer takes them by index.

Faults: a worker that dies (its process killed, out of memory) loses only its in-flight batch: the
episodes are counted (``async/dropped_episodes``), the actor is replaced and the batch is sampled
again, with the newest weights. A batch that takes longer than ``batch_timeout_s`` (a straggler:
a stuck env, a hung engine) is treated the same way. More than ``max_worker_restarts`` replacements
fail the run with the reason. Resume after a crash of the trainer restarts the workers and samples
the unfinished batches again with the restored weights: it continues correctly but, unlike
``local``, not bit for bit (the lost batches would have been sampled by older weights).
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch

from tracegym.rl.executors.base import (Executor, ExecutorStats, RolloutBatch, lag_metrics, load_trainable_state,
                                     sample_batch, trainable_state)
from tracegym.rl.executors.gate import StalenessGate


#: Longest a new rollout actor may take to build its policy and engine before it counts as stalled.
WORKER_START_TIMEOUT_S = 900.0


class RolloutWorker:
    """One rollout actor: its own policy copy, engine and envs (wrapped with ``ray.remote`` at start)."""

    def __init__(self, cfg: Any, name: str, torch_threads: int) -> None:
        # Before torch runs anything: the actor's share of the CPUs, never all of them.
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
        torch.set_num_threads(torch_threads)
        from tracegym.algos.config import PolicyLossConfig
        from tracegym.envs import make
        from tracegym.plugins import load_plugins
        from tracegym.rl.policy import load_policy, make_renderer, make_sampler

        load_plugins(cfg.plugins)
        self.cfg, self.name = cfg, name
        # No reference model in a worker: only the trainer computes KL.
        self.model, tokenizer, _ = load_policy(cfg, PolicyLossConfig(**{**cfg.policy_loss, "kl_coef": 0.0}),
                                               torch.device("cpu"))
        self.renderer = make_renderer(cfg, tokenizer)
        self.sampler = make_sampler(cfg, self.model, tokenizer, self.renderer)
        probe = make(cfg.env.name, **cfg.env.options)
        self.train_tasks = probe.tasks("train", cfg.tasks.train, cfg.tasks.seed)
        probe.close()
        self.version = -1

    def pid(self) -> int:
        return os.getpid()

    def sample(self, index: int, state: dict[str, torch.Tensor], version: int) -> RolloutBatch:
        if version != self.version:
            load_trainable_state(self.model, state)
            self.sampler.update_weights(self.model)
            self.version = version
        return sample_batch(self.sampler, self.cfg, self.renderer, self.train_tasks, index, version, self.name)


class RayExecutor(Executor):
    kind = "ray"

    def __init__(self, cfg: Any, model: torch.nn.Module, version: int) -> None:
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - ray is a dependency; a broken install says so
            raise ImportError("executor.kind: ray needs the ray package (pip install 'ray>=2.50')") from exc
        self.ray, self.cfg = ray, cfg
        ex = cfg.executor
        self._owns_ray = not ray.is_initialized()  # then close() shuts down the Ray instance it started
        if self._owns_ray:
            if ex.ray_address:
                ray.init(address=ex.ray_address, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(num_cpus=max(os.cpu_count() or 1, ex.rollout_workers * ex.worker_cpus),
                         include_dashboard=False, log_to_driver=False)
        trainer_threads = ex.trainer_threads or max(1, int((os.cpu_count() or 2) - ex.rollout_workers * ex.worker_cpus) or 1)
        self._threads_before = torch.get_num_threads()  # process-wide: restored by close()
        torch.set_num_threads(trainer_threads)
        self._actor_class = ray.remote(num_cpus=ex.worker_cpus)(RolloutWorker)
        self._worker_threads = max(1, int(ex.worker_cpus))
        self.workers: list[Any] = []
        self._names: list[str] = []
        self._up_ref: dict[int, Any] = {}  # slot -> ref that resolves once the actor has built its policy
        self._up_at: dict[int, float | None] = {}
        for i in range(ex.rollout_workers):
            self._spawn(i)
        self.gate = StalenessGate(batch_size=1, max_staleness=ex.max_staleness)
        self.gate.on_update(version)
        self.gate.skip_to(version)
        self.version = version
        self._state_ref = ray.put(trainable_state(model))
        self._next_index = version
        self._in_flight: dict[Any, tuple[int, int, float]] = {}  # ref -> (worker slot, batch index, sent at)
        self._ready: dict[int, RolloutBatch] = {}
        self._retry: list[int] = []  # batch indices lost with a worker, to sample again first
        self.restarts = 0
        self.stats = ExecutorStats()
        self._busy_s = 0.0
        self._idle_s = 0.0  # summed over workers: time between a result and the next batch sent
        self._idle_since: dict[int, float] = {}  # slot -> when it last became idle

    def _spawn(self, slot: int) -> None:
        name = f"rollout-{slot}"
        actor = self._actor_class.options(name=None).remote(self.cfg, name, self._worker_threads)
        if slot < len(self.workers):
            self.workers[slot] = actor
        else:
            self.workers.append(actor)
            self._names.append(name)
        # A batch's time limit runs from when its worker is up: loading a model is not straggling.
        self._up_ref[slot] = actor.pid.remote()
        self._up_at[slot] = None

    def _deadline(self, slot: int, sent: float) -> float:
        """When a batch sent to ``slot`` at ``sent`` counts as stalled (inf while the worker starts)."""
        if self._up_at[slot] is None:
            done, _ = self.ray.wait([self._up_ref[slot]], timeout=0)
            if not done:
                return sent + WORKER_START_TIMEOUT_S
            self._up_at[slot] = time.perf_counter()
        return max(sent, self._up_at[slot]) + self.cfg.executor.batch_timeout_s

    def _idle_slots(self) -> list[int]:
        busy = {slot for slot, _, _ in self._in_flight.values()}
        return [slot for slot in range(len(self.workers)) if slot not in busy]

    def _fill(self) -> None:
        """Send admissible batches to idle workers: lost ones first, then the next new ones."""
        for slot in self._idle_slots():
            if self._retry:
                index = self._retry.pop(0)
            elif self._next_index < self.cfg.steps and self.gate.can_start():
                self.gate.start()
                index = self._next_index
                self._next_index += 1
            else:
                return
            ref = self.workers[slot].sample.remote(index, self._state_ref, self.version)
            now = time.perf_counter()
            self._idle_s += now - self._idle_since.pop(slot, now)
            self._in_flight[ref] = (slot, index, now)

    def _replace(self, slot: int, index: int, why: str) -> None:
        """A worker died or stalled: count its batch's episodes as lost, start a new actor, queue the batch again."""
        self.restarts += 1
        self.stats.worker_failures += 1
        self.stats.dropped_episodes += self.cfg.tasks_per_step * self.cfg.group_size
        if self.restarts > self.cfg.executor.max_worker_restarts:
            raise RuntimeError(f"rollout worker {slot} failed ({why}) and executor.max_worker_restarts "
                               f"({self.cfg.executor.max_worker_restarts}) is used up")
        try:
            self.ray.kill(self.workers[slot], no_restart=True)
        except Exception:
            pass  # already gone
        self._spawn(slot)
        self._retry.append(index)

    def next_batch(self, step: int, cursor: int, round_index: int) -> RolloutBatch:
        ray = self.ray
        waited = time.perf_counter()
        while step not in self._ready:
            self._fill()
            if not self._in_flight:
                raise RuntimeError(f"no rollout is running for step {step + 1}: the staleness gate admits none "
                                   "(a bug: please report it)")
            done, _ = ray.wait(list(self._in_flight), num_returns=1, timeout=1.0)
            for ref in done:
                slot, index, sent = self._in_flight.pop(ref)
                try:
                    batch = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
                    self._replace(slot, index, f"{type(exc).__name__}")
                    continue
                self._busy_s += batch.sample_s
                self._idle_since[slot] = time.perf_counter()
                if index in self._retry:
                    self._retry.remove(index)
                self.gate.finish()
                self._ready[index] = batch
            now = time.perf_counter()
            for ref, (slot, index, sent) in list(self._in_flight.items()):
                if now > self._deadline(slot, sent):  # a straggler: never let it stall the trainer
                    del self._in_flight[ref]
                    self._replace(slot, index, f"no result after {self.cfg.executor.batch_timeout_s:g} s")
        batch = self._ready.pop(step)
        self.stats.record_trained(batch, self.version, time.perf_counter() - waited)
        return batch

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self._state_ref = self.ray.put(trainable_state(model))
        self.version = version
        self.gate.on_update(version)
        self._fill()  # workers idle on the gate start the next batches now, while the trainer logs

    def metrics(self) -> dict[str, float]:
        busy, self._busy_s = self._busy_s, 0.0
        idle, self._idle_s = self._idle_s / max(1, len(self.workers)), 0.0
        out = {**lag_metrics(self.stats), "async/rollout_busy_s": busy, "async/worker_idle_s": idle}
        self.stats.clear()
        return out

    def worker_pids(self) -> list[int]:
        return self.ray.get([w.pid.remote() for w in self.workers])

    def state_dict(self) -> dict[str, Any]:
        return {"gate": self.gate.state_dict(), "trainer_version": self.version, "restarts": self.restarts}

    def close(self) -> None:
        for worker in self.workers:
            try:
                self.ray.kill(worker, no_restart=True)
            except Exception:
                pass
        self.workers = []
        self._in_flight.clear()
        if self._owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
        torch.set_num_threads(self._threads_before)


__all__ = ["RayExecutor", "RolloutWorker"]
