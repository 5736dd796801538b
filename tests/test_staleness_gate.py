"""StalenessGate: the spec's admission numbers, synchronous behaviour at max_staleness 0, drops and
the lag histogram, blocking starts, thread safety under contention and the checkpoint round trip."""

from __future__ import annotations

import json
import queue
import random
import sys
import threading
import time
from collections import Counter

import pytest

from tracegym.rl.executors import StalenessGate


def _start(gate: StalenessGate, n: int) -> None:
    for _ in range(n):
        assert gate.try_start()


def test_spec_values_batch_4_staleness_1():
    gate = StalenessGate(batch_size=4, max_staleness=1)
    assert (gate.version, gate.capacity()) == (0, 8)  # (1 + 0 + 1) * 4 - 0
    started = sum(gate.try_start() for _ in range(10))
    assert started == 8 and gate.capacity() == 0 and not gate.can_start()
    assert gate.running == 8
    # finishing moves running -> accepted: the bound counts both, so still no room
    for _ in range(8):
        assert gate.finish(0)
    assert (gate.running, gate.accepted, gate.capacity()) == (0, 8, 0)
    assert gate.on_update() == 1  # the trainer consumed one batch and updated
    assert gate.capacity() == 4  # (1 + 1 + 1) * 4 - 8
    _start(gate, 4)
    assert gate.capacity() == 0
    gate.on_update(2)
    assert gate.capacity() == 4  # 16 - 8 accepted - 4 running
    # start() is for callers that checked can_start(): on a full gate it raises instead of counting
    with pytest.raises(RuntimeError, match=r"full: accepted 8 \+ running 8 >= \(max_staleness 1 \+ version 2 \+ 1\)"):
        _start(gate, 4)
        gate.start()


def test_max_staleness_0_is_synchronous():
    gate = StalenessGate(batch_size=4, max_staleness=0)
    for version in range(3):
        assert gate.capacity() == 4  # exactly one batch ahead of consumption
        _start(gate, 4)
        assert not gate.try_start()
        assert all(gate.finish(version) for _ in range(4))
        assert gate.capacity() == 0  # the next batch waits for this batch's update
        assert all(gate.consume(version) for _ in range(4))  # trained at lag 0
        assert gate.capacity() == 0
        gate.on_update(version + 1)
    assert gate.lag_histogram == {0: 12}
    # a sample of version 2 that finishes after the update to 3 is already one version too old
    assert gate.try_start()
    assert not gate.finish(2)
    assert gate.dropped == 1 and gate.capacity() == 4  # its slot is free again


def test_admissible_drops_and_lag_histogram():
    gate = StalenessGate(batch_size=2, max_staleness=2)
    assert gate.admissible(0, 2) and not gate.admissible(0, 3) and gate.admissible(5, 5)
    with pytest.raises(ValueError, match="newer than the trainer"):
        gate.admissible(4, 3)
    _start(gate, 6)  # capacity (2 + 0 + 1) * 2 = 6
    assert gate.capacity() == 0
    for _ in range(6):
        assert gate.finish(0)
    gate.on_update(1)
    assert gate.consume(0) and gate.consume(0)  # lag 1, 1
    gate.on_update(3)
    assert gate.consume(0) is False  # lag 3 > 2: dropped while it waited in the buffer
    assert gate.dropped == 1 and gate.accepted == 5
    assert gate.capacity() == (2 + 3 + 1) * 2 - 5  # the dropped one no longer holds a slot
    _start(gate, 2)
    assert gate.finish(3) and gate.finish(1)  # a fresh one, and a lag-2 one (still admissible)
    assert gate.consume(3) and gate.consume(1) and gate.consume(0) is False
    assert gate.lag_histogram == {1: 2, 0: 1, 2: 1}
    assert gate.dropped == 2 and gate.consumed == 4
    m = gate.metrics()
    assert m["staleness/lag_mean"] == pytest.approx((1 + 1 + 0 + 2) / 4)
    assert (m["staleness/lag_max"], m["staleness/lag_0"], m["staleness/lag_1"], m["staleness/lag_2"]) == (2.0, 1.0, 2.0, 1.0)
    assert m["staleness/dropped"] == 2.0 and m["staleness/version"] == 3.0
    assert m["staleness/buffered"] == float(gate.accepted - gate.consumed) == 2.0  # two lag-3 samples left
    # a failed rollout frees its slot without counting as accepted
    before = gate.capacity()
    _start(gate, 1)
    gate.reject()
    assert gate.rejected == 1 and gate.capacity() == before


def test_bookkeeping_errors_are_loud():
    with pytest.raises(ValueError, match="batch_size"):
        StalenessGate(batch_size=0, max_staleness=1)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(batch_size=1, max_staleness=-1)
    gate = StalenessGate(batch_size=1, max_staleness=1)
    with pytest.raises(RuntimeError, match="without a running rollout"):
        gate.finish(0)
    with pytest.raises(RuntimeError, match="without a running rollout"):
        gate.reject()
    with pytest.raises(RuntimeError, match="no accepted sample"):
        gate.consume(0)
    _start(gate, 1)
    with pytest.raises(ValueError, match="newer"):
        gate.finish(1)  # version 1 does not exist yet
    assert gate.running == 1  # the bad call changed nothing
    gate.on_update(2)
    with pytest.raises(ValueError, match="go back"):
        gate.on_update(1)
    gate.close()
    assert not gate.can_start() and not gate.try_start()
    with pytest.raises(RuntimeError, match="closed"):
        gate.start()


def test_wait_start_blocks_until_an_update_and_close_releases_waiters():
    gate = StalenessGate(batch_size=1, max_staleness=0)
    assert gate.wait_start(timeout=0.01)
    assert gate.finish(0)
    t0 = time.monotonic()
    assert gate.wait_start(timeout=0.05) is False  # full until the trainer updates
    assert time.monotonic() - t0 >= 0.04
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(gate.wait_start(timeout=10)))
    waiter.start()
    time.sleep(0.02)
    assert gate.consume(0)
    gate.on_update()  # wakes the waiter: one slot for version 1
    waiter.join(timeout=5)
    assert results == [True] and gate.running == 1
    gate.finish(1)
    waiter = threading.Thread(target=lambda: results.append(gate.wait_start(timeout=10)))
    waiter.start()
    time.sleep(0.02)
    gate.close()
    waiter.join(timeout=5)
    assert results == [True, False] and not waiter.is_alive()


def test_thread_safety_under_contention():
    """4 rollout threads and the trainer share one gate; a tiny switch interval makes the
    interpreter interleave them often. Every count must balance and no trained sample may lag
    more than max_staleness."""
    batch, staleness, updates = 3, 1, 20
    gate = StalenessGate(batch_size=batch, max_staleness=staleness)
    buffer: queue.Queue[int] = queue.Queue()
    stop = threading.Event()
    tallies: list[Counter] = []
    errors: list[BaseException] = []

    def rollouts(seed: int) -> None:
        rnd, tally = random.Random(seed), Counter()
        tallies.append(tally)
        try:
            while not stop.is_set():
                if not gate.wait_start(timeout=0.01):
                    continue
                tally["started"] += 1
                version = gate.version  # the newest weights when sampling begins
                time.sleep(rnd.random() * 0.001)
                if rnd.random() < 0.1:
                    gate.reject()
                    tally["rejected"] += 1
                elif gate.finish(version):
                    buffer.put(version)
                    tally["accepted"] += 1
                else:
                    tally["dropped_at_finish"] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=rollouts, args=(seed,), daemon=True) for seed in range(4)]
    lags: list[int] = []
    dropped_at_consume = 0
    try:
        for thread in threads:
            thread.start()
        for _ in range(updates):
            taken = 0
            while taken < batch:
                version = buffer.get(timeout=10)
                lag = gate.version - version
                if gate.consume(version):
                    lags.append(lag)
                    taken += 1
                else:
                    dropped_at_consume += 1
            gate.on_update()
    finally:
        stop.set()
        gate.close()
        for thread in threads:
            thread.join(timeout=10)
        sys.setswitchinterval(old_interval)
    assert not errors and not any(t.is_alive() for t in threads)
    total = sum(tallies, Counter())
    assert total["started"] == total["rejected"] + total["accepted"] + total["dropped_at_finish"]
    assert gate.running == 0
    assert gate.rejected == total["rejected"]
    assert gate.dropped == total["dropped_at_finish"] + dropped_at_consume
    assert gate.consumed == updates * batch == len(lags)
    assert gate.accepted == gate.consumed + buffer.qsize()  # what is left waits in the buffer
    assert max(lags) <= staleness and gate.lag_histogram == dict(Counter(lags))
    assert gate.version == updates


def test_state_round_trip_and_resume():
    gate = StalenessGate(batch_size=2, max_staleness=1)
    _start(gate, 4)
    for _ in range(3):
        gate.finish(0)
    gate.reject()
    gate.consume(0)
    gate.consume(0)
    gate.on_update()
    _start(gate, 1)
    gate.finish(1)
    gate.consume(0)
    gate.on_update()
    gate.on_update()
    gate.try_start()
    gate.finish(0)  # lag 3 > 1 at version 3: dropped
    state = json.loads(json.dumps(gate.state_dict()))  # a checkpoint is plain JSON
    assert state["version"] == 3 and state["dropped"] == 1 and state["rejected"] == 1
    assert state["lag_histogram"] == {"0": 2, "1": 1}

    resumed = StalenessGate(batch_size=2, max_staleness=1)
    resumed.load_state_dict(state)
    assert resumed.version == 3 and resumed.dropped == 1 and resumed.rejected == 1
    assert resumed.lag_histogram == {0: 2, 1: 1}
    # the buffered sample and nothing in flight survived: (1 + 1) * 2 rollouts may start, as at any resume
    assert (resumed.running, resumed.accepted, resumed.consumed) == (0, 6, 6)
    assert resumed.capacity() == 4 and resumed.metrics()["staleness/buffered"] == 0.0
    assert resumed.state_dict()["lag_histogram"] == state["lag_histogram"]
    # the same as a gate made at version 3, or skipped to it
    assert StalenessGate(batch_size=2, max_staleness=1, version=3).capacity() == 4
    skipped = StalenessGate(batch_size=2, max_staleness=1)
    skipped.on_update(3)
    assert skipped.capacity() == 10  # without skip_to the counts of versions 0..2 are missing
    skipped.skip_to(3)
    assert skipped.capacity() == 4
    with pytest.raises(ValueError, match="skip back"):
        skipped.skip_to(2)
