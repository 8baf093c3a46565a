"""The scheduler's index of a disk tier under vLLM's real Scheduler, as the workers' reports reach it: a fetched key
stays offered, a job's outcome is applied when its own ranks all reported it (not when the jobs ordered before it
did). Every run is traced, checked after every step and drained. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Collection

import pytest

pytest.importorskip("vllm")

from kvfsm.states import TierJobState  # noqa: E402
from kvfsm.tiers.blockfile import BlockFiles  # noqa: E402
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
from vllm_harness import Driver  # noqa: E402
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


def test_a_write_back_that_ended_is_offered_while_one_ordered_before_it_still_runs(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d, _ = tiered(disk_tier(tmp_path))
    slow, fast = prefix_keys(d, PREFIX), prefix_keys(d, OTHERS[0])
    released = hold_block_files(monkeypatch, slow[:1])
    d.add("slow", PREFIX + [1])
    step_until(d, lambda: tier_jobs(d, "write-back", slow), "the slow write-back was never ordered")
    d.add("fast", OTHERS[0] + [1])
    step_until(d, lambda: any(job.state in _ENDED for job in tier_jobs(d, "write-back", fast)),
               "the fast write-back never ended")
    assert not any(job.state in _ENDED for job in tier_jobs(d, "write-back", slow))
    offered = d.connector.scheduler_side.tier_index.tiers[0].lookup(fast)
    released.set()
    d.run(MAX_STEPS)
    assert offered == len(fast)


def test_a_fetch_that_ended_unpins_its_keys_while_one_ordered_before_it_still_runs(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    push_below_cpu(d, [worker])  # PREFIX, then OTHERS[0] too, are out of the CPU pool, on the disk
    slow, fast = prefix_keys(d, PREFIX), prefix_keys(d, OTHERS[0])
    released = hold_block_files(monkeypatch, slow[:1])
    d.add("slow", PREFIX + [9])
    step_until(d, lambda: tier_jobs(d, "fetch", slow), "the slow fetch was never ordered")
    d.add("fast", OTHERS[0] + [9])
    step_until(d, lambda: any(job.state in _ENDED for job in tier_jobs(d, "fetch", fast)),
               "the fast fetch never ended")
    assert not any(job.state in _ENDED for job in tier_jobs(d, "fetch", slow))
    offered = d.connector.scheduler_side.tier_index.tiers[0].lookup(fast)
    released.set()
    d.run(MAX_STEPS)
    assert offered == len(fast)
