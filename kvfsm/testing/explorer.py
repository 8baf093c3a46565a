"""Exhaustive exploration of every schedule of a small workload, breadth first, deduplicating states.

A schedule is the sequence of choices nothing in the code fixes: whether the host takes its next action (an engine
step, a new request, a preemption), one of the device's runnable streams executes its next operation, or a lower
tier's oldest queued read or write runs ("io": a disk, or a real Mooncake store on a local master). The
explorer enumerates them all for a small workload (2–3 requests sharing a prefix, a handful of GPU blocks, a CPU
pool of a few blocks, one preemption), checking the same invariants, bytes and outputs as the generated
interleavings at every state. Engine, connector and device state cannot be copied (operations are closures), so
each state is rebuilt by replaying its choices; states whose fingerprint (host progress, queued operations and tier
I/O, memory and disk bytes, job, request and tier-entry states) was already seen are not expanded again. Host
blocking inside `handle_preemptions` runs the device in a fixed order: its interleavings are the one thing not
enumerated.

With tensor parallelism (`Workload.ranks` 2) every rank's device is a choice of its own: rank 0's streams by name
as with one device, rank r's as "r:stream".
"""

from __future__ import annotations

import hashlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from kvfsm.executor.sim import SimDevice
from kvfsm.testing.explorer_workloads import Workload, step
from kvfsm.testing.harness import SHAPE, TP_SHAPE, Harness
from kvfsm.testing.mooncake_store import shared_master
from kvfsm.testing.mutants import MUTANTS, TP_MUTANTS

Choice = str  # "host", "io", a stream name of rank 0's device, or "rank:stream" of another rank's


@dataclass
class Exploration:
    states: int = 0
    schedules_completed: int = 0
    violation: list[str] = field(default_factory=list)
    counterexample: tuple[Choice, ...] = ()
    exhausted: bool = False
    """Every reachable state was explored (not cut off by the state budget)."""

    @property
    def clean(self) -> bool:
        return not self.violation


class _Replay:
    """A harness driven by a choice sequence."""

    def __init__(self, workload: Workload, mutant: str | None) -> None:
        self.workload = workload
        devices = [SimDevice() for _ in range(workload.ranks)]
        self.harness = Harness(devices if workload.ranks > 1 else devices[0], num_gpu_blocks=workload.num_gpu_blocks,
                               cpu_blocks=workload.cpu_blocks,
                               block_size_factor=workload.block_size_factor, mutant=mutant,
                               replicated=workload.replicated, per_layer=workload.per_layer, layer_loads=workload.layer_loads,
                               layer_stores=workload.layer_stores,
                               disk_slots=workload.disk_slots, writeback_bound_blocks=workload.writeback_bound_blocks,
                               mooncake_master=shared_master() if workload.mooncake else None,
                               staging_blocks=workload.staging_blocks, store_threshold=workload.store_threshold,
                               eviction=workload.eviction, store_bound=workload.store_bound,
                               writeback_queue_blocks=workload.writeback_queue_blocks,
                               shape=TP_SHAPE if workload.ranks > 1 else SHAPE)
        self.host_index = 0

    def host_can_act(self) -> bool:
        w = self.workload
        return self.host_index < len(w.actions) or (
            self.harness.engine.has_work and self.host_index < len(w.actions) + w.max_extra_steps)

    def apply(self, choice: Choice) -> None:
        if choice == "io":
            self.harness.io.run_one(0)
            return
        if choice != "host":
            rank, _, stream = choice.rpartition(":")
            self.harness.devices[int(rank or 0)].run_one(stream)  # type: ignore[arg-type]
            return
        actions = self.workload.actions
        (actions[self.host_index] if self.host_index < len(actions) else step)(self.harness)
        self.host_index += 1
        if self.workload.device_eager:
            self.harness.device.run_until_idle()

    def choices(self) -> list[Choice]:
        devices = self.harness.devices
        return ((["host"] if self.host_can_act() else []) + list(devices[0].runnable())
                + [f"{rank}:{stream}" for rank in range(1, len(devices)) for stream in devices[rank].runnable()]
                + (["io"] if self.harness.io.queue else []))

    def fingerprint(self) -> str:
        h = self.harness
        digest = hashlib.blake2b(digest_size=16)
        queues = [(s, labels) for d in h.devices for s, labels in d.queued().items()]
        digest.update(repr((self.host_index, queues,
                            sorted((j.job_id, j.state) for j in h.connector.scheduler.jobs.values()),
                            sorted((r.request_id, r.phase.name, r.num_computed, r.num_sampled)
                                   for r in h.engine.live.values()),
                            h.io.numbers, sorted((e.key, e.state) for t in h.world.tiers for e in t.entries),
                            sorted((j.job_id, j.state) for j in h.world.tier_jobs.values()))).encode())
        ranks = h.engine.ranks.local if h.engine.ranks is not None else ()
        for cache in [*h.engine.caches, *(c for rank in ranks[1:] for c in rank.caches)]:
            digest.update(cache.numpy().tobytes())
        for worker in h.connector.workers:
            digest.update(worker.pool.buffer.numpy().tobytes())
        if h.disk is not None:
            for path in sorted(h.disk.directory.iterdir()):
                digest.update(path.name.encode() + path.read_bytes())
        return digest.hexdigest()


Closer = Callable[[Harness], None]


def _visit(workload: Workload, mutant: str | None, path: tuple[Choice, ...],
           close: Closer = Harness.close) -> tuple[str, list[str], list[Choice]]:
    """Rebuild the state `path` leads to: its fingerprint, what is wrong there, and the choices it offers."""
    replay = _Replay(workload, mutant)
    try:
        for choice in path:
            replay.apply(choice)
        key = replay.fingerprint()
        found, options = replay.harness.violations(), replay.choices()
        if not options and not found:  # the scripted host is done: finish the requests, then judge the run
            replay.harness.drain()
            found = replay.harness.final_violations()
    except Exception as error:  # a refused trigger or a broken engine is a finding, not a crash
        key, found, options = repr(path), [f"{type(error).__name__}: {error}"], []
    finally:
        close(replay.harness)
    return key, found, options


def fits(workload: Workload, mutant: str) -> bool:
    """Whether the mutant's bug can show in this workload's engine (a per-layer bug needs per-layer hooks, a bug of
    a bound needs that bound set, one of a busy pool a pool small enough to fill)."""
    needs = (MUTANTS | TP_MUTANTS)[mutant]
    return ((needs.per_layer is None or needs.per_layer == workload.per_layer)
            and (not needs.layer_loads or workload.layer_loads) and (not needs.layer_stores or workload.layer_stores)
            and (needs.store_threshold == 1 or needs.store_threshold == workload.store_threshold)
            and (needs.store_bound is None or workload.store_bound is not None)
            and (needs.queue_bound is None or workload.writeback_queue_blocks is not None)
            and (needs.max_cpu_blocks is None or workload.cpu_blocks <= needs.max_cpu_blocks))


def explore(workload: Workload, mutant: str | None = None, max_states: int = 5000) -> Exploration:
    """Breadth-first search over schedules; stops at the first violation (a shortest counterexample)."""
    if not workload.mooncake:
        return _search(workload, mutant, max_states, Harness.close)
    with _BatchCloser() as closer:
        return _search(workload, mutant, max_states, closer.close)


class _BatchCloser:
    """Closes replays' harnesses in batches, each batch's closes at once on threads.

    A Mooncake client's close waits about a second for its own threads (without the GIL), and a client set up while
    another closes waits for that close: closing each replay inline, or in the background, costs a second a state.
    Closed together, a batch costs about one second."""

    def __init__(self, batch: int = 32) -> None:
        self.batch = batch
        self._open: list[Harness] = []
        self._threads = ThreadPoolExecutor(max_workers=batch, thread_name_prefix="kvfsm-explorer-close")

    def close(self, harness: Harness) -> None:
        self._open.append(harness)
        if len(self._open) >= self.batch:
            self.flush()

    def flush(self) -> None:
        closing, self._open = self._open, []
        for _ in self._threads.map(Harness.close, closing):
            pass  # a close that failed raises here: a finding too

    def __enter__(self) -> _BatchCloser:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.flush()
        finally:
            self._threads.shutdown()


def _search(workload: Workload, mutant: str | None, max_states: int, close: Closer) -> Exploration:
    result = Exploration()
    seen: set[str] = set()
    frontier: deque[tuple[Choice, ...]] = deque([()])
    while frontier and result.states < max_states:
        path = frontier.popleft()
        key, found, options = _visit(workload, mutant, path, close)
        if key in seen:
            continue
        seen.add(key)
        result.states += 1
        if found:
            result.violation, result.counterexample = found, path
            return result
        if not options:
            result.schedules_completed += 1
        frontier.extend((*path, choice) for choice in options)
    result.exhausted = not frontier
    return result
