"""A shared disk tier: its blocks outlive the engine and serve every engine of the same namespace on the host, and
`disk-block-whole` holds across processes: a block is visible only once whole (never torn by a concurrent reader or
a kill -9) and is loaded only once verified (a corrupted or foreign file is a miss, and counted)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np
import pytest
import torch

from kvfsm.config import DiskTierConfig, OffloadConfig
from kvfsm.connector import Connector
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.sim import SimDevice
from kvfsm.machines import default_machines
from kvfsm.mooncake.keys import KvNamespace
from kvfsm.testing.harness import Harness
from kvfsm.testing.tier_mutants import publish_in_place, unverified_read
from kvfsm.tier_invariants import disk_block_whole
from kvfsm.tiers.base import TierCompletion, TierFailure
from kvfsm.tiers.blockfile import RECORD, TEMPORARY, BlockFiles, DiskIo
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.io import ManualIo, io_threads

BLOCK = 4096
MODEL = KvNamespace(model_id="toy@1", dtype="bfloat16", layout="kv-first", block_tokens=16)
FORK = multiprocessing.get_context("fork")  # the children only touch files and threads, never a device


def _tier(path: Path, slots: int = 8, namespace: KvNamespace = MODEL, **options: object) -> DiskTier:
    """A shared tier whose lookups wait for their `stat`s as long as a busy test machine may need (unless told)."""
    options.setdefault("lookup_timeout_s", 10.0)
    return DiskTier("disk", path, slots * BLOCK, BLOCK, options.pop("io", ManualIo()),  # type: ignore[arg-type]
                    machines=default_machines(), namespace=namespace, **options)  # type: ignore[arg-type]


def _block(key: int, writer: int = 0) -> np.ndarray:
    return np.random.default_rng(key * 7 + writer).integers(0, 256, BLOCK, dtype=np.uint8)


def _settle(tier: DiskTier, timeout_s: float = 10.0) -> list[TierCompletion]:
    """Run or wait for the tier's I/O until every job was reported."""
    done, deadline = [], time.monotonic() + timeout_s
    while tier.busy:
        assert time.monotonic() < deadline, "the tier's I/O did not end"
        if isinstance(tier._io, ManualIo):
            tier._io.run_all()
        done += tier.poll()
        time.sleep(0.001)
    return done


def _write(tier: DiskTier, keys: Sequence[int], job: int = 1, writer: int = 0) -> list[TierCompletion]:
    tier.submit_write(job, list(keys), [memoryview(_block(k, writer)) for k in keys])
    return _settle(tier)


def _read(tier: DiskTier, keys: Sequence[int], job: int = 2) -> tuple[list[np.ndarray], TierCompletion]:
    out = [np.zeros(BLOCK, dtype=np.uint8) for _ in keys]
    tier.submit_read(job, list(keys), [memoryview(o) for o in out])
    (done,) = _settle(tier)
    return out, done


# --- restart ---------------------------------------------------------------------------------------------------


def test_a_restarted_tier_serves_what_it_wrote_and_hands_back_each_blocks_stored_checksum(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    assert [c.ok for c in _write(tier, [1, 2, 3])] == [True]
    tier.close()
    again = _tier(tmp_path)
    assert again.found.keys and again.lookup([1, 2, 3]) == 3
    out, done = _read(again, [1, 2, 3])
    assert done.ok and all(np.array_equal(o, _block(k)) for o, k in zip(out, (1, 2, 3)))
    assert done.checksums == {k: zlib.crc32(_block(k)) for k in (1, 2, 3)}
    again.close()


def test_a_named_disk_tier_opens_its_namespaces_directory_and_keeps_it_at_close(tmp_path: Path) -> None:
    config = OffloadConfig(cpu_blocks=4, gpu_block_size=4, lower_tiers=[DiskTierConfig(
        path=str(tmp_path), capacity_bytes=1 << 20, model_id="toy@1", kv_dtype="float32")])
    connector = Connector(config, SimDevice())
    connector.register_kv_caches(allocate_kv_caches("kv-first", 2, 8, 4, 1, 4, torch.float32, "cpu")[0], "kv-first")
    (tier,) = connector.worker.lower_tiers
    connector.worker.shutdown()
    assert tier.shared and tier.directory.name.startswith("kvfsm2-") and tier.directory.is_dir()  # type: ignore


def test_a_tier_of_another_namespace_sees_none_of_the_blocks(tmp_path: Path) -> None:
    _write(_tier(tmp_path), [1])
    other = _tier(tmp_path, namespace=MODEL.model_copy(update={"model_id": "toy@2"}))
    assert other.lookup([1]) == 0 and other.found.keys == []


def test_a_block_file_of_another_namespace_under_this_ones_name_is_a_corrupt_miss(tmp_path: Path) -> None:
    mine, theirs = _tier(tmp_path), _tier(tmp_path, namespace=MODEL.model_copy(update={"dtype": "float16"}))
    _write(mine, [1])
    _write(theirs, [1])
    shutil.copyfile(theirs.files.path(1), mine.files.path(1))  # same size, same key, another namespace's record
    out, done = _read(mine, [1])
    assert dict(done.failed) == {1: TierFailure.corrupt} and not done.checksums
    assert not mine.files.path(1).exists() and mine.lookup([1]) == 0


def test_on_opening_the_tier_keeps_the_newest_blocks_that_fit_and_removes_the_rest(tmp_path: Path) -> None:
    tier = _tier(tmp_path, slots=3)
    _write(tier, [1, 2, 3])
    for age, key in enumerate((3, 1, 2)):  # written long ago: 3, then 1, then 2
        os.utime(tier.files.path(key), ns=(10**18 + age, 10**18 + age))
    again = _tier(tmp_path, slots=2)
    assert again.found.keys == [1, 2] and again.found.over_capacity == 1 and not again.files.path(3).exists()
    _write(again, [4], job=3)  # full: evicts the least recently written, 1
    assert (again.lookup([1]), again.lookup([2]), again.lookup([4])) == (0, 1, 1)


def test_opening_a_directory_of_many_blocks_reads_none_of_them(tmp_path: Path) -> None:
    """Start-up is one listing: its time grows with the number of files, not with their bytes."""
    tier = _tier(tmp_path, slots=2000)
    for job, first in enumerate(range(0, 2000, 100)):
        _write(tier, range(first, first + 100), job=job)
    started = time.monotonic()
    again = _tier(tmp_path, slots=2000)
    elapsed = time.monotonic() - started
    print(f"\nopened a directory of 2000 blocks in {elapsed * 1000:.0f} ms")
    assert len(again.found.keys) == 2000 and elapsed < 5.0


# --- a lookup never stalls the scheduling step on a slow disk --------------------------------------------------

SLOW_STAT_S = 0.3
LOOKUP_BOUND_S = 0.02


def _lookup_on_a_slow_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           control: bool) -> tuple[int, float, int, int]:
    """Another engine wrote key 7; this engine's `stat` of it takes `SLOW_STAT_S`. (what the first lookup counts,
    its seconds, what a lookup counts while that `stat` is still running, how many `stat`s ran by then)."""
    reader = _tier(tmp_path, lookup_timeout_s=LOOKUP_BOUND_S)
    writer = _tier(tmp_path)
    _write(writer, [7], writer=1)
    writer.close()
    stats: list[int] = []

    def slow(key: int) -> bool:
        stats.append(key)
        time.sleep(SLOW_STAT_S)
        return BlockFiles.visible(reader.files, key)

    monkeypatch.setattr(reader.files, "visible", slow)
    if control:  # no bound to speak of: the lookup waits for the `stat`s however long they take
        monkeypatch.setattr(reader._lookups, "timeout_s", 3600.0)
    started = time.monotonic()
    counted = reader.lookup([7])
    took = time.monotonic() - started
    again = reader.lookup([7])
    reader.close()
    return counted, took, again, len(stats)


def test_a_lookup_waits_for_a_slow_disk_at_most_its_bound_and_counts_a_miss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counted, took, again, stats = _lookup_on_a_slow_disk(tmp_path, monkeypatch, control=False)
    assert counted == 0 and took < SLOW_STAT_S / 2, (counted, took)
    assert again == 0 and stats == 1  # while the late stat runs, lookups answer from the index and queue no stat


def test_a_lookup_adopts_a_block_another_engine_wrote_once_the_disk_answers_in_time(tmp_path: Path) -> None:
    reader, writer = _tier(tmp_path, lookup_timeout_s=LOOKUP_BOUND_S * 50), _tier(tmp_path)
    _write(writer, [7], writer=1)
    writer.close()
    assert reader.lookup([7]) == 1
    reader.close()


def test_control_a_lookup_without_a_bound_stalls_for_the_whole_stat(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counted, took, _, _ = _lookup_on_a_slow_disk(tmp_path, monkeypatch, control=True)
    assert counted == 1 and took >= SLOW_STAT_S, (counted, took)


# --- a block is visible only once whole ------------------------------------------------------------------------


class _HalfThenWait(DiskIo):
    """Writes a block's record and half its bytes, says so, then waits for `go` (a slow disk, or a writer about to
    be killed)."""

    def __init__(self, half: Any, go: Any) -> None:
        self.half, self.go = half, go

    def write(self, fd: int, parts: Sequence[memoryview]) -> None:
        record, block = parts
        super().write(fd, [record, block[:BLOCK // 2]])
        self.half.set()
        self.go.wait()
        super().write(fd, [block[BLOCK // 2:]])


def _writer_holding_half_a_block(path: str, half: object, go: object, control: bool) -> None:
    """Another engine: writes key 7 and stops half-way until `go` (or until it is killed)."""
    tier = _tier(Path(path), io=io_threads(1, "writer"), disk_io=_HalfThenWait(half, go))  # type: ignore[arg-type]
    if control:
        publish_in_place(tier)
    _write(tier, [7], writer=1)
    tier.close()


def _seen_by_a_reader_while_another_process_writes(tmp_path: Path, control: bool) -> tuple[int, list[str], bool]:
    """(what this engine's lookup counts, what `disk-block-whole` finds, whether the read matched the writer's bytes
    once its write ended)."""
    reader = _tier(tmp_path)
    half, go = FORK.Event(), FORK.Event()
    writer = FORK.Process(target=_writer_holding_half_a_block, args=(str(tmp_path), half, go, control))
    writer.start()
    try:
        assert half.wait(10), "the writer never reached the middle of its block"
        counted, found = reader.lookup([7]), disk_block_whole(SimpleNamespace(tiers=[reader]))  # type: ignore[arg-type]
    finally:
        go.set()
        writer.join(10)
    if counted:
        reader.discard([7])  # what it counted mid-write; the whole block is there now
    out, done = _read(reader, [7]) if reader.lookup([7]) else ([], None)
    return counted, found, done is not None and done.ok and np.array_equal(out[0], _block(7, writer=1))


def test_a_block_another_process_is_writing_is_invisible_until_whole(tmp_path: Path) -> None:
    counted, found, served = _seen_by_a_reader_while_another_process_writes(tmp_path, control=False)
    assert (counted, found, served) == (0, [], True)


def test_control_written_in_place_a_half_written_block_is_visible_and_caught(tmp_path: Path) -> None:
    _, found, _ = _seen_by_a_reader_while_another_process_writes(tmp_path, control=True)
    assert found == ["disk: 7.kv is visible under its block's name but not whole"], found


def _killed_mid_write(tmp_path: Path, control: bool) -> list[str]:
    """Kill -9 a writer half-way through key 7; what `disk-block-whole` then finds through an engine that shares
    the directory (opened before the kill)."""
    live = _tier(tmp_path, io_timeout_s=3600)
    half, go = FORK.Event(), FORK.Event()
    writer = FORK.Process(target=_writer_holding_half_a_block, args=(str(tmp_path), half, go, control))
    writer.start()
    assert half.wait(10), "the writer never reached the middle of its block"
    os.kill(writer.pid, signal.SIGKILL)  # type: ignore[arg-type]
    writer.join(10)
    assert writer.exitcode == -signal.SIGKILL
    assert control or live.lookup([7]) == 0
    return disk_block_whole(SimpleNamespace(tiers=[live]))  # type: ignore[arg-type]


def test_a_writer_killed_mid_write_leaves_a_torn_block_no_reader_sees_and_the_next_start_removes(
        tmp_path: Path) -> None:
    assert _killed_mid_write(tmp_path, control=False) == []
    directory = _tier(tmp_path, io_timeout_s=3600).directory
    (torn,) = [p for p in directory.iterdir() if p.name.endswith(TEMPORARY)]
    assert torn.stat().st_size == RECORD.size + BLOCK // 2
    live = _tier(tmp_path, io_timeout_s=3600)  # an engine starting while its writer may still be alive keeps it
    assert live.lookup([7]) == 0 and live.found.torn == 0 and torn.exists()
    os.utime(torn, (time.time() - 60, time.time() - 60))
    later = _tier(tmp_path, io_timeout_s=30)  # untouched past any write's deadline: its writer is gone
    assert later.found.torn == 1 and not torn.exists() and later.lookup([7]) == 0


def test_control_written_in_place_a_writer_killed_mid_write_leaves_a_torn_block_visible_and_caught(
        tmp_path: Path) -> None:
    assert _killed_mid_write(tmp_path, control=True) == ["disk: 7.kv is visible under its block's name but not whole"]


# --- a block is loaded only once verified ---------------------------------------------------------------------


def _serve(h: Harness, prompt: tuple[int, ...]) -> None:
    h.engine.reset_prefix_cache()
    h.add_request(prompt, 1)
    h.drain()


A, B = (11, 12, 13, 14), (21, 22, 23, 24)


def _restarted_engine(directory: Path, corrupt: bool = False,
                      control: bool = False) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """An engine writes A and B to a shared disk and stops; a second one, started on the same directory (its files
    corrupted first if `corrupt`), serves A. (the second's tokens loaded per tier, its tier failures, its
    violations)."""
    first = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4, shared_disk=directory)
    _serve(first, A + (1,))
    _serve(first, B + (2,))
    assert first.final_violations() == []
    first.close()
    second = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4, shared_disk=directory)
    second.disk._lookups.timeout_s = 10.0  # type: ignore[union-attr]  # a busy test machine's stat is no miss
    try:
        found = second.disk.found.keys  # type: ignore[union-attr]
        assert len(found) == 4
        for choice in range(4) if corrupt else ():
            second.disk.lookup([found[choice]])  # type: ignore[union-attr]
            second.tier_faults.inject("corrupt-block", choice)  # one byte of the block's file flipped on disk
        if control:
            unverified_read(second.disk)  # type: ignore[arg-type]
        _serve(second, A + (3,))
        stats = second.connector.scheduler.tiers.stats  # type: ignore[union-attr]
        return dict(stats.tokens_loaded_from), dict(stats.failures), second.final_violations()
    finally:
        second.close()


def test_a_restarted_engine_serves_a_prefix_from_the_disk_its_predecessor_wrote(tmp_path: Path) -> None:
    loaded, failures, violations = _restarted_engine(tmp_path)
    assert violations == [] and not failures and loaded.get("disk") == 4


def test_a_block_corrupted_on_disk_is_a_counted_miss_and_the_engine_recomputes(tmp_path: Path) -> None:
    loaded, failures, violations = _restarted_engine(tmp_path, corrupt=True)
    assert violations == [] and failures.get("corrupt", 0) >= 1 and not loaded.get("disk")


def test_control_read_unverified_a_corrupted_block_is_loaded_and_caught(tmp_path: Path) -> None:
    _, _, violations = _restarted_engine(tmp_path, corrupt=True, control=True)
    assert any(line.startswith(("ready-means-written", "output")) for line in violations), violations


# --- two processes writing one directory ------------------------------------------------------------------------

KEYS = range(32)
ROUNDS = 4


def _write_and_read_everything(path: str, writer: int, results: multiprocessing.Queue) -> None:
    """One engine: writes every key (its own bytes for each), reads every key back, forgets and removes them, again
    and again, while another engine does the same in the same directory."""
    tier = _tier(Path(path), slots=len(KEYS), io=io_threads(4, f"writer{writer}"))
    outcome = {"ok": 0, "missing": 0, "corrupt": 0, "wrong": 0}
    for round_ in range(ROUNDS):
        _write(tier, KEYS, job=3 * round_, writer=writer)
        keys = [k for k in KEYS if tier.lookup([k])]
        out, done = _read(tier, keys, job=3 * round_ + 1)
        for key, block in zip(keys, out):
            if key not in done.failed:
                whole = any(np.array_equal(block, _block(key, w)) for w in (1, 2))
                outcome["ok" if whole else "wrong"] += 1
        for reason in done.failed.values():
            outcome[str(reason.value)] = outcome.get(str(reason.value), 0) + 1
        tier.discard(list(KEYS))
    _write(tier, KEYS, job=99, writer=writer)
    tier.close()
    results.put(outcome)


def test_two_processes_writing_one_directory_never_corrupt_each_other(tmp_path: Path) -> None:
    results = FORK.Queue()
    writers = [FORK.Process(target=_write_and_read_everything, args=(str(tmp_path), w, results)) for w in (1, 2)]
    for writer in writers:
        writer.start()
    outcomes = [results.get(timeout=60) for _ in writers]
    for writer in writers:
        writer.join(10)
        assert writer.exitcode == 0
    print(f"\ntwo writers, {ROUNDS} rounds of {len(KEYS)} keys each: {outcomes}")
    assert all(o["corrupt"] == 0 and o["wrong"] == 0 and o["ok"] > 0 for o in outcomes), outcomes
    after = _tier(tmp_path, slots=len(KEYS))
    assert after.found.torn == 0 and after.torn_visible() == [] and after.lookup(list(KEYS)) == len(KEYS)
    out, done = _read(after, list(KEYS))
    assert done.ok and all(any(np.array_equal(b, _block(k, w)) for w in (1, 2)) for k, b in zip(KEYS, out))
