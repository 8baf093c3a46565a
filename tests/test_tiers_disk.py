"""The disk tier: publish after write, pinned reads, own eviction, a private tier that starts empty, and each fault it
meets in service ending as a miss or a failed fetch the engine recomputes, with nothing wrong loaded."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from kvfsm.config import DiskTierConfig, OffloadConfig
from kvfsm.connector import Connector
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.sim import SimDevice
from kvfsm.machines import default_machines
from kvfsm.testing.harness import Harness
from kvfsm.testing.tier_faults import FAULTS
from kvfsm.tiers.base import LowerTier, TierFailure, TierMisuse
from kvfsm.tiers.blockfile import DiskIo
from kvfsm.tiers.disk import DiskTier, DiskTierError
from kvfsm.tiers.entries import TierEntries
from kvfsm.tiers.io import ManualIo, io_threads

BLOCK = 64


def _tier(path: Path, slots: int = 2, **options: object) -> DiskTier:
    return DiskTier("disk", path, slots * BLOCK, BLOCK, options.pop("io", ManualIo()),  # type: ignore[arg-type]
                    machines=default_machines(), **options)  # type: ignore[arg-type]


def _block(value: int) -> memoryview:
    return memoryview(np.full(BLOCK, value, dtype=np.uint8))


def test_disk_tier_implements_the_lower_tier_protocol(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    assert isinstance(tier, LowerTier)
    tier.close()


def test_a_key_is_published_only_after_its_write_returned(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.submit_write(1, [7], [_block(3)])
    assert tier.lookup([7]) == 0 and tier.entries.get(7).state == "writing"  # type: ignore[union-attr]
    tier._io.run_all()  # type: ignore[attr-defined]
    assert tier.lookup([7]) == 0, "bytes written but not yet polled: not published"
    assert [c.ok for c in tier.poll()] == [True]
    assert tier.lookup([7]) == 1 and tier.stored_bytes(7) == bytes(_block(3))
    tier.close()


def test_a_read_returns_the_bytes_written(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.submit_write(1, [7, 8], [_block(3), _block(4)])
    tier._io.run_all()  # type: ignore[attr-defined]
    tier.poll()
    out = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(2)]
    tier.submit_read(2, [7, 8], [memoryview(o) for o in out])
    tier._io.run_all()  # type: ignore[attr-defined]
    assert [c.ok for c in tier.poll()] == [True]
    assert out[0].tolist() == [3] * BLOCK and out[1].tolist() == [4] * BLOCK
    tier.close()


def test_a_read_pins_its_entry_so_a_full_tier_refuses_a_write_instead_of_evicting_it(tmp_path: Path) -> None:
    tier = _tier(tmp_path, slots=1)
    tier.submit_write(1, [7], [_block(3)])
    tier._io.run_all()  # type: ignore[attr-defined]
    tier.poll()
    tier.submit_read(2, [7], [memoryview(np.zeros(BLOCK, dtype=np.uint8))])
    tier.submit_write(3, [8], [_block(4)])
    tier._io.run_all()  # type: ignore[attr-defined]
    outcomes = {c.job_id: dict(c.failed) for c in tier.poll()}
    assert outcomes == {2: {}, 3: {8: TierFailure.full}}
    tier.close()


def test_the_tier_evicts_its_least_recently_used_key_when_full(tmp_path: Path) -> None:
    tier = _tier(tmp_path, slots=2)
    for job, key in enumerate((1, 2, 3)):
        tier.submit_write(job, [key], [_block(key)])
        tier._io.run_all()  # type: ignore[attr-defined]
        tier.poll()
    assert (tier.lookup([1]), tier.lookup([2]), tier.lookup([3])) == (0, 1, 1)
    tier.close()


def test_a_private_tier_starts_empty_after_a_restart(tmp_path: Path) -> None:
    """Without a namespace (no model named) nothing a previous process wrote, or half wrote, can be served."""
    tier = _tier(tmp_path)
    tier.submit_write(1, [7], [_block(3)])
    tier._io.run_all()  # type: ignore[attr-defined]
    tier.poll()
    tier._io = ManualIo()  # a crash: the process dies without closing the tier
    again = _tier(tmp_path)
    assert again.lookup([7]) == 0 and len(again.entries) == 0 and list(again.directory.iterdir()) == []
    again.close()
    assert list(tmp_path.iterdir()) == [], "a private tier's directory outlived its close"


def test_misuse_raises_before_anything_changes(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    with pytest.raises(TierMisuse):
        tier.submit_write(1, [7], [memoryview(np.zeros(BLOCK - 1, dtype=np.uint8))])
    with pytest.raises(TierMisuse):
        tier.submit_write(1, [7, 7], [_block(1), _block(2)])
    assert len(tier.entries) == 0 and not tier.busy
    tier.close()


def test_a_disk_that_cannot_hold_the_tier_is_a_clear_error_at_start(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match="cannot hold"):
        DiskTier("disk", tmp_path, 1 << 62, BLOCK, ManualIo(), machines=default_machines())
    assert list(tmp_path.iterdir()) == []


def test_a_tier_without_the_connectors_machines_is_refused_at_construction(tmp_path: Path) -> None:
    """No global machine set to fall back on: entries moved by a machine nobody observes would escape the checks."""
    with pytest.raises(TypeError, match="MachineSet"):
        TierEntries("disk", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="machines"):
        DiskTier("disk", tmp_path, 2 * BLOCK, BLOCK, ManualIo())  # type: ignore[call-arg]
    assert list(tmp_path.iterdir()) == []


class _BuggyWrite(DiskIo):
    """A write that raises an error no disk produces (a bug in the I/O code), for the blocks of one value."""

    def __init__(self, value: int) -> None:
        self.value = value

    def write(self, fd: int, parts: Sequence[memoryview]) -> None:
        if parts[-1][0] == self.value:
            raise RuntimeError("a bug in the write path")
        super().write(fd, parts)


def test_a_bug_in_the_io_surfaces_only_after_every_finished_job_settled(tmp_path: Path) -> None:
    tier = _tier(tmp_path, slots=3, disk_io=_BuggyWrite(value=3))
    tier.submit_write(1, [7], [_block(3)])  # the bug
    tier.submit_write(2, [8], [_block(4)])
    tier._io.run_all()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="a bug in the write path"):
        tier.poll()
    assert tier.entries.get(7) is None and tier.entries.get(8).state == "published"  # type: ignore[union-attr]
    assert not tier.busy, "a job was left half settled"
    assert {c.job_id: dict(c.failed) for c in tier.poll()} == {1: {7: TierFailure.io_error}, 2: {}}
    assert tier.poll() == []
    tier.close()


class _HungWrite(DiskIo):
    """A write that does not return until the test lets it (a hung disk)."""

    def __init__(self) -> None:
        self.returns = threading.Event()

    def write(self, fd: int, parts: Sequence[memoryview]) -> None:
        self.returns.wait()
        super().write(fd, parts)


def test_closing_a_tier_waits_for_hung_io_no_longer_than_its_deadline(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hung = _HungWrite()
    tier = _tier(tmp_path, disk_io=hung, io=io_threads(1, "disk"), io_timeout_s=0.2)
    tier.submit_write(1, [7], [_block(3)])
    rescue = threading.Timer(5.0, hung.returns.set)  # a close that waits on the disk fails the test, not hangs it
    rescue.start()
    started = time.monotonic()
    tier.close()
    assert time.monotonic() - started < 2.0, "close waited on the hung disk"
    assert tier._closing.daemon, "the release left waiting on the disk would hold the process's exit"  # type: ignore
    assert tier._closing.name == "kvfsm-disk-close", "a thread dump of the stuck process names the tier"  # type: ignore
    assert ("disk tier 'disk': I/O still running 0.2s after close; its directory is released when it returns"
            in caplog.messages)
    rescue.cancel()
    assert tier.directory.exists(), "the directory was released under a write still running"
    hung.returns.set()
    tier._closing.join(10)  # type: ignore[union-attr]
    assert not tier.directory.exists(), "the directory was not released once the write returned"


@pytest.mark.parametrize("bad", [
    {"cpu_blocks": 4, "lower_tiers": [{"kind": "disk", "path": "/tmp", "capacity_bytes": 0}]},
    {"cpu_blocks": 4, "lower_tiers": [{"kind": "disk", "path": "/tmp", "capacity_bytes": 64, "io_threads": 0}]},
    {"cpu_blocks": 4, "lower_tiers": [{"kind": "tape", "path": "/tmp", "capacity_bytes": 64}]},
    {"cpu_blocks": 4, "lower_tiers": [{"kind": "disk", "path": "/tmp", "capacity_bytes": 64}] * 2},
    {"cpu_blocks": 4, "lower_tiers": [{"kind": "disk", "path": "/etc/hostname", "capacity_bytes": 64}]},
    {"cpu_blocks": 4, "lower_tiers": [{"kind": "disk", "path": "/tmp", "capacity_bytes": 64, "model_id": "m"}]},
    {"cpu_blocks": 4, "lower_tiers": [{"kind": "disk", "path": "/tmp", "capacity_bytes": 64, "kv_dtype": "bf16"}]},
    {"cpu_blocks": 4, "lower_tiers": [{"kind": "disk", "path": "/tmp", "capacity_bytes": 64, "model_id": "",
                                       "kv_dtype": "bf16"}]},
    {"cpu_blocks": 4, "writeback_max_bytes_in_flight": 0},
])
def test_tier_settings_are_validated(bad: dict) -> None:
    with pytest.raises(ValidationError):
        OffloadConfig.model_validate(bad)


def test_valid_tier_settings_load() -> None:
    config = OffloadConfig.model_validate({"cpu_blocks": 4, "lower_tiers": [
        {"kind": "disk", "path": "/tmp/kv", "capacity_bytes": 1 << 30, "writeback": "eager"}]})
    assert isinstance(config.lower_tiers[0], DiskTierConfig) and config.lower_tiers[0].tier_name == "disk"


# --- faults end as a miss or a failed fetch the engine recomputes ---------------------------------------------

A, B = (11, 12, 13, 14), (21, 22, 23, 24)
WRITE_FAULTS = {"disk-full", "write-io-error"}


def _serve(h: Harness, prompt: tuple[int, ...]) -> None:
    h.engine.reset_prefix_cache()
    h.add_request(prompt, 1)
    h.drain()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_tier_fault_ends_as_a_miss_or_failed_fetch_and_nothing_wrong_is_loaded(fault: str) -> None:
    h = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4)
    try:
        if fault in WRITE_FAULTS:
            h.tier_faults.inject(fault)  # A's write-back meets it
        _serve(h, A + (1,))
        _serve(h, B + (2,))  # pushes A out of the CPU pool; A stays on disk unless its write-back failed
        h.engine.reset_prefix_cache()
        if fault not in WRITE_FAULTS | {"stall"}:
            h.tier_faults.inject(fault)
        h.add_request(A + (3,), 1)
        h.engine.step()  # A's lookup orders the fetch and defers; the worker submits the read
        if fault == "stall":
            h.tier_faults.inject(fault)  # the disk hangs before the read returns
            h.engine.step()
        h.drain()
        stats = h.connector.scheduler.tiers.stats  # type: ignore[union-attr]
        seen = ", ".join(f"{reason} x{n}" for reason, n in stats.failures.items()) or "no failure"
        print(f"\n{fault}: engine saw {seen}; fetched {sum(stats.blocks_fetched.values())} blocks; "
              f"violations {h.final_violations()}")
        assert h.final_violations() == []
        assert stats.failures, f"{fault} was injected but no tier job failed"
    finally:
        h.close()


def test_without_a_fault_the_returning_prefix_is_fetched_from_disk() -> None:
    """The control of the fault table: the same run without a fault serves the prefix from disk."""
    h = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4)
    try:
        _serve(h, A + (1,))
        _serve(h, B + (2,))
        _serve(h, A + (3,))
        stats = h.connector.scheduler.tiers.stats  # type: ignore[union-attr]
        assert h.final_violations() == [] and not stats.failures
        assert stats.blocks_fetched["disk"] == 2 and stats.tokens_loaded_from["disk"] == 4
    finally:
        h.close()


def test_the_tier_counters_add_every_write_back_and_every_fetch() -> None:
    h = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4)
    try:
        for prompt in (A + (1,), B + (2,), A + (3,), B + (4,)):  # both written back, then both fetched back
            _serve(h, prompt)
        stats = h.connector.scheduler.tiers.stats  # type: ignore[union-attr]
        assert (stats.blocks_written_back["disk"], stats.blocks_fetched["disk"]) == (4, 4)
        assert h.final_violations() == []
    finally:
        h.close()


def test_a_cache_reset_forgets_what_the_disk_tier_published() -> None:
    h = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4)
    try:
        _serve(h, A + (1,))
        _serve(h, B + (2,))  # A now only on disk
        h.connector.reset_cache()
        _serve(h, A + (3,))
        stats = h.connector.scheduler.tiers.stats  # type: ignore[union-attr]
        assert stats.blocks_fetched.get("disk", 0) == 0, "a prefix from before the reset was fetched back"
        assert h.final_violations() == []
    finally:
        h.close()


def test_write_backs_in_flight_stay_within_their_byte_bound() -> None:
    h = Harness(SimDevice(), num_gpu_blocks=16, cpu_blocks=4, disk_slots=4, writeback_bound_blocks=1)
    try:
        tiers = h.connector.scheduler.tiers
        assert tiers is not None
        h.add_request(A + B + (1,), 1)
        peak = 0
        for _ in range(40):
            h.engine.step()
            h.settle()
            peak = max(peak, sum(j.nbytes for j in h.connector.scheduler.tier_jobs.values()
                                 if j.kind == "write-back" and j.in_flight))
        assert 0 < peak <= tiers.bound and tiers.stats.blocks_written_back["disk"] == 4
        assert tiers.stats.writebacks_held > 0, "no candidate ever waited for the bound"
        assert h.final_violations() == []
    finally:
        h.close()


# --- every transition of the tier lifecycles is taken -------------------------------------------------------

TIER_CPU_TRIGGERS = {"write-back", "written-back", "allocate-fetch", "fetch-done", "fetch-failed", "abandon-fetch",
                     "abandon-write-back"}


def _declared_tier_edges() -> set[tuple[str, str, str, str]]:
    from kvfsm.machines import default_machines
    from kvfsm.testing.coverage import declared_edges

    return {e for e in declared_edges(default_machines().spec)
            if e[0] in ("tier-entry", "tier-job") or (e[0] == "cpu-block" and (
                e[2] in TIER_CPU_TRIGGERS or (e[2] == "reset" and e[1] in ("writing-back", "fetching"))))}


def _edges_of_a_returning_prefix(fault: str | None, reset: str | None) -> set[tuple[str, str, str, str]]:
    h = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=3)
    try:
        if fault in WRITE_FAULTS:
            h.tier_faults.inject(fault)
        h.add_request(A + (1,), 1)
        while not h.connector.scheduler.tier_jobs:
            h.engine.step()
            h.device.run_until_idle()  # the device, not the disk: the write-back's write has not run
        if reset in ("write-back", "write-back-then-stall"):
            h.connector.reset_cache()
        if reset in ("stall-write-back", "write-back-then-stall"):  # the disk hangs past the write-back's deadline
            h.tier_faults.inject("stall")
            h.engine.step()
        _serve(h, A + (1,))
        _serve(h, B + (2,))
        h.tier_faults.evict_one(0) if fault == "tier-evicts" else None
        h.engine.reset_prefix_cache()
        if fault not in WRITE_FAULTS | {"stall", None, "tier-evicts"}:
            h.tier_faults.inject(fault)
        h.add_request(A + (3,), 1)
        h.engine.step()
        if reset == "fetch-then-stall":  # its slots orphaned by the reset before the fetch is abandoned
            h.connector.reset_cache()
        if fault == "stall" or reset == "fetch-then-stall":
            h.tier_faults.inject("stall")
            h.engine.step()
        if reset == "fetch":
            h.connector.reset_cache()
        h.drain()
        _serve(h, (31, 32, 33, 34, 5))  # a third prefix: the full disk evicts its least recent key
        assert h.final_violations() == []
        return h.trace.edges
    finally:
        h.close()


ONLY_A_SHARED_STORE_TAKES = {("tier-entry", "empty", "adopt", "published")}
"""A private disk holds only what its own process wrote; adoption is taken by the shared disk's tests
(`test_tiers_disk_shared.py`) and the Mooncake tier's."""

ONLY_A_QUEUE_BOUND_TAKES = {("tier-job", "created", "shed", "shed")}
"""A write-back is shed only past a tier's `writeback_max_queued_blocks`, which these scenarios do not set; the
back-pressure tests take it (`test_tier_backpressure.py`)."""


def test_the_tier_scenarios_take_every_transition_of_the_tier_lifecycles() -> None:
    taken: set[tuple[str, str, str, str]] = set()
    for fault in (None, "tier-evicts", *FAULTS):
        for reset in (None, "fetch", "write-back", "stall-write-back", "fetch-then-stall", "write-back-then-stall"):
            taken |= _edges_of_a_returning_prefix(fault, reset)
    missing = _declared_tier_edges() - taken - ONLY_A_SHARED_STORE_TAKES - ONLY_A_QUEUE_BOUND_TAKES
    assert not missing, f"tier transitions no scenario takes: {sorted(missing)}"


def test_the_fault_free_path_alone_leaves_tier_transitions_untaken() -> None:
    """The control of the coverage check: without faults and resets, failure and orphan edges are missing."""
    missing = _declared_tier_edges() - _edges_of_a_returning_prefix(None, None)
    assert ("tier-job", "submitted", "abandon", "abandoned") in missing


@pytest.mark.parametrize("keep_history", [True, False])
def test_a_connector_keeps_its_tiers_lookups_exactly_when_it_keeps_history(tmp_path: Path,
                                                                             keep_history: bool) -> None:
    """The tier invariants read what each lookup counted; an engine's connector keeps nothing it would not read."""
    config = OffloadConfig(cpu_blocks=4, gpu_block_size=4,
                           lower_tiers=[DiskTierConfig(path=str(tmp_path), capacity_bytes=1 << 20)])
    connector = Connector(config, SimDevice(), keep_history=keep_history)
    connector.register_kv_caches(allocate_kv_caches("kv-first", 2, 8, 4, 1, 4, torch.float32, "cpu")[0], "kv-first")
    (tier,) = connector.worker.lower_tiers
    try:
        assert tier.entries.keep_lookups is keep_history
        assert tier.directory.name.endswith("-0")  # one directory per worker rank
    finally:
        connector.worker.shutdown()
