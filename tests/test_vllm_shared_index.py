"""The scheduler's index of a shared disk tier under vLLM's real Scheduler: the keys it adopts from the tier's
directory (`directory_lookup`: blocks another engine wrote), the keys a fetch of them failed on, and what it keeps
about both. Engine A (a second driver in this process, on the same named directory) writes a prefix back; engine B
then finds it in the directory. Both run the adapter's real worker role, traced and checked after every step and
drained. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import kvfsm.integrations.vllm.tier_index as tier_index  # noqa: E402
from kvfsm.integrations.vllm.directory_lookup import DirectoryLookup  # noqa: E402
from kvfsm.integrations.vllm.tier_index import ReportedTier  # noqa: E402
from kvfsm.testing.census import census  # noqa: E402
from kvfsm.tiers.blockfile import DiskIo  # noqa: E402
from test_vllm_disk_two_engines import shared_disk  # noqa: E402
from test_vllm_tiers import MAX_STEPS, PREFIX, fetches, holds_prefix, prefix_keys, tiered  # noqa: E402
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import hold_disk_reads, loads_of, model  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm


def engine_a_writes_prefix(tiered, path: Path) -> None:
    """Engine A writes PREFIX back to the shared directory."""
    a, _ = tiered(shared_disk(path))
    a.add("writer", PREFIX + [1, 2, 3])
    a.run(MAX_STEPS)


def reads_fail(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every disk read fails (`EIO`: the block's file stays in the directory, whole) until the returned event is
    set: a key the directory shows that no fetch of it can read."""
    healed = threading.Event()
    read = DiskIo.read

    def failing(self: DiskIo, fd: int, parts: Any) -> int:
        if not healed.is_set():
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return read(self, fd, parts)

    monkeypatch.setattr(DiskIo, "read", failing)
    return healed


def engine_b(tiered, path: Path) -> tuple[Driver, AdapterWorker, ReportedTier]:
    """Engine B on the same directory, stepped once (its worker tells its scheduler the directory); its index."""
    b, (worker,) = tiered(shared_disk(path))
    b.step()
    (index,) = b.connector.scheduler_side.tier_index.tiers
    return b, worker, index


def until_a_fetch_failed(b: Driver) -> None:
    """Step B until a fetch of the tier failed (the index settled it in the same step)."""
    while not sum(b.connector.scheduler_side.kvfsm.tiers.stats.failures.values()):
        assert b.step_no < MAX_STEPS, "no fetch failed"
        b.step()


def b_after_a_failed_fetch(tiered, path: Path, monkeypatch: pytest.MonkeyPatch
                           ) -> tuple[Driver, AdapterWorker, ReportedTier, threading.Event]:
    """A wrote PREFIX to the directory; B's reader of it was stepped until B's fetch of it failed (reads fail until
    the returned event is set)."""
    engine_a_writes_prefix(tiered, path)
    b, worker, index = engine_b(tiered, path)
    healed = reads_fail(monkeypatch)
    b.add("reader", PREFIX + [9])
    until_a_fetch_failed(b)
    return b, worker, index, healed


def forget_everything(b: Driver) -> None:
    """A cache reset on B: its index forgets the tier's keys, and its worker removes their files."""
    b.reset_gpu_prefix_cache()
    assert b.connector.reset_cache()
    b.run(MAX_STEPS)


def test_keys_adopted_from_the_directory_are_offered_by_the_index_alone(tiered, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once B loaded A's prefix, its index holds every key: a lookup answers them all without asking the directory."""
    engine_a_writes_prefix(tiered, tmp_path)
    b, worker, index = engine_b(tiered, tmp_path)
    b.add("reader", PREFIX + [9])
    b.run(MAX_STEPS)
    (load,) = loads_of(b, "reader")
    assert holds_prefix(worker, load)
    asked: list[tuple[int, ...]] = []
    present = DirectoryLookup.present
    monkeypatch.setattr(DirectoryLookup, "present", lambda self, keys: asked.append(tuple(keys)) or present(self, keys))
    keys = prefix_keys(b, PREFIX)
    assert index.lookup(keys) == len(keys) and not asked


def test_a_lookup_that_stops_at_a_key_being_fetched_does_not_ask_the_directory(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key the index holds, being read, cannot be adopted again: asking the directory would only cost the step a
    wait."""
    engine_a_writes_prefix(tiered, tmp_path)
    b, _, index = engine_b(tiered, tmp_path)
    released = hold_disk_reads(monkeypatch)
    b.add("reader", PREFIX + [9])
    while not index.reads_in_flight():
        assert b.step_no < MAX_STEPS, "no fetch was ordered"
        b.step()
    asked: list[tuple[int, ...]] = []
    present = DirectoryLookup.present
    monkeypatch.setattr(DirectoryLookup, "present", lambda self, keys: asked.append(tuple(keys)) or present(self, keys))
    answer = index.lookup(prefix_keys(b, PREFIX))
    released.set()
    b.run(MAX_STEPS)
    assert answer == 0 and not asked


def test_a_key_whose_fetch_from_the_directory_failed_is_not_adopted_from_it_again(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory still holds the files whole: adopting them again would order a fetch that fails every step."""
    b, _, index, healed = b_after_a_failed_fetch(tiered, tmp_path, monkeypatch)
    assert index.lookup(prefix_keys(b, PREFIX)) == 0
    healed.set()
    b.run(MAX_STEPS)
    assert "reader" in b.first_token and len(fetches(b)) == 1


def test_a_key_whose_fetch_failed_is_adopted_from_the_directory_again_once_this_engine_wrote_it_back(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B's reader recomputed the prefix and B wrote it back: the directory's files are B's own now, good to adopt
    (after a cache reset made B forget them, once their files are back)."""
    b, worker, index, healed = b_after_a_failed_fetch(tiered, tmp_path, monkeypatch)
    healed.set()
    b.run(MAX_STEPS)
    (disk,) = worker.connector.worker_side.kvfsm.lower_tiers
    written = {f: f.read_bytes() for f in disk.directory.rglob("*") if f.is_file()}  # type: ignore[attr-defined]
    keys = prefix_keys(b, PREFIX)
    assert len(written) == len(keys), "B did not write the prefix back"
    forget_everything(b)
    for file, data in written.items():  # another engine writes the same blocks again
        file.write_bytes(data)
    assert index.lookup(keys) == len(keys)


def test_past_the_bound_only_the_oldest_key_a_fetch_failed_on_may_be_adopted_again(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for 3 shunned keys, a fetch of 4 that all fail leaves the first (the oldest) adoptable."""
    monkeypatch.setattr(tier_index, "SHUNNED_KEYS", 3)
    b, _, index, healed = b_after_a_failed_fetch(tiered, tmp_path, monkeypatch)
    assert index.lookup(prefix_keys(b, PREFIX)) == 1
    healed.set()
    b.run(MAX_STEPS)


@pytest.mark.parametrize("forgotten", ["cache-reset", "failed-fetch"])
def test_the_index_remembers_no_key_the_directory_showed_once_it_forgot_it(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forgotten: str) -> None:
    """Bounded bookkeeping: the keys adopted from the directory are remembered as such only while the index holds
    them, whether a cache reset or a failed fetch dropped them."""
    engine_a_writes_prefix(tiered, tmp_path)
    b, _, index = engine_b(tiered, tmp_path)
    b.add("reader", PREFIX + [9])
    if forgotten == "failed-fetch":
        reads_fail(monkeypatch)
        until_a_fetch_failed(b)
    else:
        b.run(MAX_STEPS)
        assert index.shown, "B adopted nothing from the directory"
        b.reset_gpu_prefix_cache()
        assert b.connector.reset_cache()  # checked at once: the workers' echo of the discards comes steps later
    assert not len(index.entries) and census(index)[f"ReportedTier[{index.name}].shown"] == 0
    b.run(MAX_STEPS)
