"""A disk tier's faults under vLLM's real Scheduler: each ends as a miss or a recompute, with 0 bytes wrong and no
exception reaching vLLM. A full disk (`ENOSPC`), a disk hung past its deadline, a corrupted block and a key the disk
evicted between the scheduler's lookup and the worker's read. Each is produced where the real one arises, in the
worker's disk tier (`kvfsm.testing.tier_faults`), each run is traced, checked after every step and drained, and each
has a control with its rule removed that the same test catches. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.integrations.vllm.tier_index import ReportedTier  # noqa: E402
from kvfsm.states import TierJobState  # noqa: E402
from kvfsm.testing.tier_faults import TierFaults  # noqa: E402
from kvfsm.testing.tier_mutants import failed_fetch_loads, unverified_read  # noqa: E402
from kvfsm.tiers.base import FutureCalls  # noqa: E402
from kvfsm.tiers.disk import DiskTier  # noqa: E402
from test_vllm_tiers import (  # noqa: E402
    MAX_STEPS,
    PREFIX,
    corrupt_slot_file,
    disk_tier,
    evict_from_cpu_then_reload,
    fetches,
    holds_prefix,
    prefix_keys,
    push_below_cpu,
    tiered,
)
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import loads_of, model  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm

HUNG_STEPS = 200
"""Steps the reader gets to be served while the disk hangs (it needs a handful once the deadline passed)."""


def worker_disk(worker: AdapterWorker) -> DiskTier:
    (disk,) = worker.connector.worker_side.kvfsm.lower_tiers
    assert isinstance(disk, DiskTier)
    return disk


def tier_stats(d: Driver) -> Any:
    return d.connector.scheduler_side.kvfsm.tiers.stats


def recomputed_with_no_wrong_byte(d: Driver, worker: AdapterWorker) -> None:
    """The fault's end: the reader ran, every block it loaded (if any) holds its prefix's bytes, and all drained."""
    assert "reader" in d.first_token
    assert all(holds_prefix(worker, load) for load in loads_of(d, "reader"))
    assert d.cpu_pool_drained()


def on_scheduler(d: Driver) -> Any:
    """The scheduler half as `kvfsm.testing.tier_mutants` reaches it through the reference engine's connector."""
    return SimpleNamespace(scheduler=d.connector.scheduler_side.kvfsm)


def adopt_failed_write_backs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A control: the scheduler's index publishes every key of an ended write-back, failed ones too."""
    settle = ReportedTier.settle

    def adopting(self: ReportedTier) -> None:
        ended = [job for job in self._writes.values() if job.state not in (TierJobState.CREATED,
                                                                           TierJobState.SUBMITTED)]
        settle(self)
        for job in ended:
            for key in job.failed_keys:
                self.entries.adopt(key)

    monkeypatch.setattr(ReportedTier, "settle", adopting)


# --- disk full -------------------------------------------------------------------------------------------------


def full_disk_then_reload(tiered, path: Path) -> tuple[Driver, AdapterWorker]:
    d, (worker,) = tiered(disk_tier(path))
    TierFaults(worker_disk(worker)).io.full = True  # every write fails ENOSPC, as on a disk other files filled
    evict_from_cpu_then_reload(d, [worker])
    return d, worker


def test_a_full_disk_fails_its_write_backs_and_the_reader_recomputes(tiered, tmp_path: Path) -> None:
    d, worker = full_disk_then_reload(tiered, tmp_path)
    stats = tier_stats(d)
    assert stats.failures["full"] > 0 and stats.blocks_written_back["disk"] == 0
    assert not fetches(d) and not loads_of(d, "reader")
    recomputed_with_no_wrong_byte(d, worker)


def test_control_an_index_that_publishes_a_failed_write_back_is_caught(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adopt_failed_write_backs(monkeypatch)
    with pytest.raises(SpecViolation, match="publish-after-write.*no write-back of it ended on every rank"):
        full_disk_then_reload(tiered, tmp_path)


# --- a disk hung past its deadline -----------------------------------------------------------------------------


def hang_the_next_read(faults: TierFaults, returned: threading.Event) -> threading.Event:
    """The disk's next read blocks until the returned event is set (`returned` is set once it did return)."""
    release = threading.Event()
    read = faults.io.read

    def hung(fd: int, parts: Sequence[memoryview]) -> int:
        faults.io.read = read  # type: ignore[method-assign]  # one read hangs; a retry would not
        release.wait(30)
        try:
            return read(fd, parts)
        finally:
            returned.set()

    faults.io.read = hung  # type: ignore[method-assign]
    return release


def served_while_the_disk_hangs(d: Driver, worker: AdapterWorker, deadline: Callable[[TierFaults], None]) -> bool:
    """The reader's fetch hangs in the disk; once it is in flight `deadline` runs (the disk's clock passes the
    tier's deadline). Whether the reader got its first token before the hung read returned; then the read returns
    and the run drains."""
    faults = TierFaults(worker_disk(worker))
    push_below_cpu(d, [worker])
    returned = threading.Event()
    release = hang_the_next_read(faults, returned)
    d.add("reader", PREFIX + [9])
    while not fetches(d):
        assert d.step_no < MAX_STEPS, "no fetch was ordered"
        d.step()
    deadline(faults)
    for _ in range(HUNG_STEPS):
        if "reader" in d.first_token:
            break
        d.step()
    served = "reader" in d.first_token and not returned.is_set()
    release.set()
    d.run(MAX_STEPS)
    return served


def test_a_disk_hung_past_its_deadline_is_a_miss_and_the_reader_recomputes_meanwhile(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    assert served_while_the_disk_hangs(d, worker, lambda faults: faults.inject("stall"))
    stats = tier_stats(d)
    assert stats.failures["timeout"] > 0 and stats.tokens_loaded_from["disk"] == 0
    assert not loads_of(d, "reader")
    recomputed_with_no_wrong_byte(d, worker)


def test_control_a_disk_with_no_deadline_holds_the_reader_until_it_returns(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    init = FutureCalls.__init__
    monkeypatch.setattr(FutureCalls, "__init__", lambda self, futures, deadline: init(self, futures, float("inf")))
    d, (worker,) = tiered(disk_tier(tmp_path))
    assert not served_while_the_disk_hangs(d, worker, lambda faults: faults.inject("stall"))


# --- a corrupted block -----------------------------------------------------------------------------------------


def test_a_corrupted_block_fails_its_fetch_and_the_reader_recomputes(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    evict_from_cpu_then_reload(d, [worker], lambda: corrupt_slot_file(worker))
    stats = tier_stats(d)
    assert fetches(d) and stats.failures["corrupt"] > 0 and stats.tokens_loaded_from["disk"] == 0
    assert not loads_of(d, "reader")
    recomputed_with_no_wrong_byte(d, worker)


def test_control_a_disk_that_loads_blocks_unverified_serves_the_corrupted_bytes(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    unverified_read(worker_disk(worker))
    (load,) = evict_from_cpu_then_reload(d, [worker], lambda: corrupt_slot_file(worker))
    assert not holds_prefix(worker, load)


# --- a key evicted between the lookup and the fetch ------------------------------------------------------------


def evicted_before_its_fetch(tiered, path: Path, control: Callable[[Driver], None] = lambda d: None) -> Driver:
    d, (worker,) = tiered(disk_tier(path))
    control(d)
    faults = TierFaults(worker_disk(worker))
    evict_from_cpu_then_reload(d, [worker], lambda: faults.inject("evict-before-fetch"))
    return d


def test_a_key_the_disk_evicted_after_the_lookup_fails_its_fetch_and_is_forgotten(tiered, tmp_path: Path) -> None:
    d = evicted_before_its_fetch(tiered, tmp_path)
    assert len(fetches(d)) == 1, "the index offered the lost key again"
    assert tier_stats(d).failures["missing"] > 0
    loaded = sum(len(load.gpu_blocks) for load in loads_of(d, "reader"))
    assert loaded < len(prefix_keys(d, PREFIX)), "a lost key loaded"
    recomputed_with_no_wrong_byte(d, d.worker)  # type: ignore[arg-type]


def test_control_a_failed_fetch_whose_slots_are_loaded_anyway_is_caught(tiered, tmp_path: Path) -> None:
    with pytest.raises(SpecViolation, match="fetch-lands-private|lost-key-is-miss"):
        evicted_before_its_fetch(tiered, tmp_path, lambda d: failed_fetch_loads(None, on_scheduler(d)))
