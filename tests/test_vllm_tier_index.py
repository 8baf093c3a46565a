"""The scheduler's index of a disk tier under vLLM's real Scheduler, as the workers' reports reach it: a fetched key
stays offered, a job's outcome is applied when its own ranks all reported it (not when the jobs ordered before it
did), and a key a rank evicted while a fetch of it still runs on another rank is forgotten when that fetch ends.
Every run is traced, checked after every step and drained. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Collection

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm.tier_index import ReportedTier  # noqa: E402
from kvfsm.states import TierEntryState, TierJobState  # noqa: E402
from kvfsm.testing.census import census  # noqa: E402
from kvfsm.tiers.blockfile import BlockFiles, DiskIo  # noqa: E402
from kvfsm.tiers.disk import DiskTier  # noqa: E402
from test_vllm_tiers import (  # noqa: E402
    MAX_STEPS,
    OTHERS,
    PREFIX,
    disk_tier,
    evict_from_cpu_then_reload,
    prefix_keys,
    push_below_cpu,
    tiered,
)
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import model  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm

_ENDED = (TierJobState.DONE, TierJobState.FAILED)


def hold_block_files(monkeypatch: pytest.MonkeyPatch, keys: Collection[int]) -> threading.Event:
    """Every disk tier's writes and reads of `keys`' block files wait until the returned event is set (30 s at
    most); other keys' go through (on the tier's other I/O threads): one job falls behind while the next runs."""
    released = threading.Event()
    write, read = BlockFiles.write, BlockFiles.read

    def held_write(self: BlockFiles, key: int, source: memoryview, carried: int | None = None) -> int:
        if key in keys:
            released.wait(30)
        return write(self, key, source, carried)

    def held_read(self: BlockFiles, key: int, destination: memoryview) -> int:
        if key in keys:
            released.wait(30)
        return read(self, key, destination)

    monkeypatch.setattr(BlockFiles, "write", held_write)
    monkeypatch.setattr(BlockFiles, "read", held_read)
    return released


def tier_jobs(d: Driver, kind: str, keys: Collection[int]) -> list[Any]:
    """The scheduler's tier jobs of `kind` ("write-back" or "fetch") that carry any of `keys`."""
    return [job for job in d.connector.scheduler_side.kvfsm.tier_jobs.values()
            if job.kind == kind and set(job.keys) & set(keys)]


def step_until(d: Driver, ready: Any, what: str) -> None:
    while not ready():
        assert d.step_no < MAX_STEPS, what
        d.step()


def test_a_fetched_key_is_still_offered_after_its_fetch(tiered, tmp_path: Path) -> None:
    """A fetch unpins its keys when it ends: the disk still holds them, and the next reader is served from it."""
    d, (worker,) = tiered(disk_tier(tmp_path))
    evict_from_cpu_then_reload(d, [worker])
    keys = prefix_keys(d, PREFIX)
    assert d.connector.scheduler_side.tier_index.tiers[0].lookup(keys) == len(keys)


@pytest.mark.parametrize("kind", ["write-back", "fetch"])
def test_a_tier_job_that_ended_is_settled_while_one_ordered_before_it_still_runs(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A write-back that ended is offered, a fetch that ended unpins its keys, while the same kind of job ordered
    before it still runs (its block file held)."""
    d, (worker,) = tiered(disk_tier(tmp_path))
    if kind == "fetch":
        push_below_cpu(d, [worker])  # PREFIX, then OTHERS[0] too, are out of the CPU pool, on the disk
    slow, fast = prefix_keys(d, PREFIX), prefix_keys(d, OTHERS[0])
    released = hold_block_files(monkeypatch, slow[:1])
    d.add("slow", PREFIX + [9])
    step_until(d, lambda: tier_jobs(d, kind, slow), f"the slow {kind} was never ordered")
    d.add("fast", OTHERS[0] + [9])
    step_until(d, lambda: any(job.state in _ENDED for job in tier_jobs(d, kind, fast)), f"the fast {kind} never ended")
    assert not any(job.state in _ENDED for job in tier_jobs(d, kind, slow))
    offered = d.connector.scheduler_side.tier_index.tiers[0].lookup(fast)
    released.set()
    d.run(MAX_STEPS)
    assert offered == len(fast)


class _HeldReads(DiskIo):
    """One rank's disk, whose reads wait until `released` is set (30 s at most)."""

    def __init__(self, released: threading.Event) -> None:
        self.released = released

    def read(self, fd: int, parts: Any) -> int:
        self.released.wait(30)
        return super().read(fd, parts)


def _disk(worker: AdapterWorker) -> DiskTier:
    (disk,) = worker.connector.worker_side.kvfsm.lower_tiers
    assert isinstance(disk, DiskTier)
    return disk


def evicted_by_rank_0_while_rank_1_reads(tiered, path: Path) -> tuple[Driver, ReportedTier, list[int]]:
    """Two ranks fetch PREFIX; rank 1's reads wait while rank 0, its reads done, evicts the prefix's last key on its
    own (as a write needing room would: `TierFaults.evict_one`'s way), and its report reaches the scheduler while
    the fetch is still in flight there. Then rank 1 reads and the run drains. The index and the prefix's keys."""
    d, workers = tiered(disk_tier(path), ranks=2)
    push_below_cpu(d, workers)
    keys, index = prefix_keys(d, PREFIX), d.connector.scheduler_side.tier_index.tiers[0]
    released = threading.Event()
    rank0, rank1 = _disk(workers[0]), _disk(workers[1])
    rank1.files.disk = _HeldReads(released)
    d.add("reader", PREFIX + [9])

    def rank_0_read_them() -> bool:
        return bool(index.reads_in_flight()) and all(
            (entry := rank0.entries.get(key)) is not None and entry.state == TierEntryState.PUBLISHED for key in keys)

    step_until(d, rank_0_read_them, "rank 0 never read the prefix")
    rank0.discard(keys[-1:])
    d.step()  # rank 0's report of the eviction
    assert index.reads_in_flight(), "the fetch ended before the eviction reached the scheduler"
    released.set()
    d.run(MAX_STEPS)
    return d, index, keys


def test_a_key_a_rank_evicted_while_another_still_fetched_it_is_forgotten_when_the_fetch_ends(
        tiered, tmp_path: Path) -> None:
    _, index, keys = evicted_by_rank_0_while_rank_1_reads(tiered, tmp_path)
    assert index.lookup(keys) == len(keys) - 1


def test_the_index_keeps_no_deferred_eviction_once_the_fetch_ended(tiered, tmp_path: Path) -> None:
    """Bounded bookkeeping: a key kept for eviction after a fetch is let go once it was evicted."""
    _, index, _ = evicted_by_rank_0_while_rank_1_reads(tiered, tmp_path)
    assert census(index)[f"ReportedTier[{index.name}]._evict_after_read"] == 0
