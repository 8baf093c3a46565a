"""Two vLLM engines in two processes on one host share a named disk tier's directory: engine B, running, is served
disk -> CPU -> GPU exactly the bytes engine A (a process of its own, `vllm_engines.ForkedEngine`) wrote back, its
scheduler having found them in the directory (`directory_lookup`); and a block torn by a kill -9 of A mid-write is
a miss for B, never visible to it under the block's name (`disk-block-whole`). Both engines run vLLM's real
Scheduler and the adapter's real worker role, traced and checked after every step and drained. Each rule has a
control that breaks it and is caught. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm.directory_lookup import DirectoryLookup  # noqa: E402
from kvfsm.testing.tier_mutants import publish_in_place  # noqa: E402
from kvfsm.tier_invariants import disk_block_whole  # noqa: E402
from kvfsm.tiers.blockfile import TEMPORARY, DiskIo  # noqa: E402
from test_vllm_tiers import (  # noqa: E402
    MAX_STEPS,
    OTHERS,
    PREFIX,
    disk_tier,
    fetches,
    misplace_fetches,
    prefix_keys,
    tiered,
)
from vllm_engines import FORK, WAIT_S, ForkedEngine, blocks_bytes  # noqa: E402
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import model  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm

TORN = OTHERS[0]
"""The prompt whose write-back A is killed in."""


def shared_disk(path: Path) -> dict[str, Any]:
    """A named disk tier: its directory is its namespace's, shared by every engine of it on the host."""
    return disk_tier(path, model_id="tiny@1", kv_dtype="float16")


class _HalfThenHang(DiskIo):
    """Writes a block file's record and half its bytes, says so, then never returns (until its process is
    killed)."""

    def __init__(self, half: Any) -> None:
        self.half = half

    def write(self, fd: int, parts: Sequence[memoryview]) -> None:
        record, block = parts
        super().write(fd, [record, block[:block.nbytes // 2]])
        self.half.set()
        threading.Event().wait()


def torn_write(half: Any, in_place: bool) -> Callable[[Driver, AdapterWorker], None]:
    """What A does once PREFIX is written back (in A): write TORN back on a disk that stops half-way through each
    block (written straight under the block's name if `in_place`, the control), stepping until one is half-written."""
    def then(d: Driver, worker: AdapterWorker) -> None:
        (disk,) = worker.connector.worker_side.kvfsm.lower_tiers
        if in_place:
            publish_in_place(disk)  # type: ignore[arg-type]
        disk.files.disk = _HalfThenHang(half)  # type: ignore[attr-defined]
        d.add("torn", TORN + [1])
        while not half.is_set():
            assert d.step_no < MAX_STEPS, "A never began writing TORN back"
            d.step()

    return then


@pytest.fixture
def engine_a(model) -> Iterator[Callable[..., ForkedEngine]]:
    """`engine_a(tier, then)`: engine A over `tier` in a process of its own, writing PREFIX back then doing `then`;
    killed at the test's end if still up."""
    started: list[ForkedEngine] = []

    def start(tier: dict[str, Any], then: Callable[[Driver, AdapterWorker], None]) -> ForkedEngine:
        started.append(ForkedEngine(model.model, tier, PREFIX + [1, 2, 3], then))
        return started[-1]

    yield start
    for engine in started:
        engine.close()


def two_engines(tiered, engine_a, path: Path, in_place: bool = False) -> SimpleNamespace:
    """B starts on the shared directory and steps once (its worker tells its scheduler the directory); A, forked
    then, writes PREFIX back, sends its bytes, and is killed half-way through writing TORN back. Then B serves a
    reader of PREFIX and a reader of TORN. What `disk-block-whole` found through B's tier right after the kill, A's
    PREFIX bytes, B's driver and worker."""
    b, (worker,) = tiered(shared_disk(path))
    b.step()
    half = FORK.Event()
    a = engine_a(shared_disk(path), torn_write(half, in_place))
    written = a.written()
    assert half.wait(WAIT_S), "A never half-wrote a block of TORN"
    a.kill()
    torn = disk_block_whole(SimpleNamespace(tiers=worker.connector.worker_side.kvfsm.lower_tiers))  # type: ignore
    for req_id, prompt in (("reader", PREFIX + [9]), ("torn-reader", TORN + [9])):
        b.add(req_id, prompt)
        b.run(MAX_STEPS)
    return SimpleNamespace(torn=torn, written=written, b=b, worker=worker)


def loads(b: Driver, req_id: str) -> list[Any]:
    return [o for log in b.log for o in log.orders.loads if o.req_id == req_id]


def test_engine_b_is_served_from_the_shared_disk_exactly_the_bytes_engine_a_wrote_back(
        tiered, engine_a, tmp_path: Path) -> None:
    seen = two_engines(tiered, engine_a, tmp_path)
    (load,) = loads(seen.b, "reader")
    assert blocks_bytes(seen.worker, list(load.gpu_blocks)) == seen.written
    assert [log.first_computed["reader"] for log in seen.b.log if "reader" in log.first_computed] == [len(PREFIX)]
    assert seen.b.connector.scheduler_side.kvfsm.tiers.stats.tokens_loaded_from["disk"] == len(PREFIX)
    assert seen.b.cpu_pool_drained()


def test_a_block_torn_by_a_kill_of_engine_a_mid_write_is_a_miss_for_engine_b(tiered, engine_a,
                                                                              tmp_path: Path) -> None:
    seen = two_engines(tiered, engine_a, tmp_path)
    (disk,) = seen.worker.connector.worker_side.kvfsm.lower_tiers
    assert any(f.name.endswith(TEMPORARY) for f in disk.directory.iterdir()), "the kill left no torn write"
    assert seen.torn == []
    torn_keys = set(prefix_keys(seen.b, TORN))
    assert not [f for f in fetches(seen.b) if torn_keys & set(f.keys)] and not loads(seen.b, "torn-reader")
    assert "torn-reader" in seen.b.first_token


def test_control_a_block_published_in_place_is_visible_torn_after_the_kill_and_caught(
        tiered, engine_a, tmp_path: Path) -> None:
    """A writes TORN straight under each block's name: the kill leaves torn files there, which `disk-block-whole`
    finds through B's tier (B's scheduler still skips them by size, and B's read would fail their CRC-32)."""
    seen = two_engines(tiered, engine_a, tmp_path, in_place=True)
    assert seen.torn and all("visible under its block's name but not whole" in line for line in seen.torn)


def test_control_a_scheduler_that_never_asks_the_directory_serves_engine_b_nothing(
        tiered, engine_a, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter before `directory_lookup`: B's index knows only what B wrote, and the reader recomputes."""
    monkeypatch.setattr(DirectoryLookup, "present", lambda self, keys: 0)
    seen = two_engines(tiered, engine_a, tmp_path)
    assert not loads(seen.b, "reader") and not fetches(seen.b)


def test_control_a_fetch_that_lands_in_the_wrong_cpu_slots_serves_b_bytes_other_than_as(
        tiered, engine_a, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    misplace_fetches(monkeypatch)
    seen = two_engines(tiered, engine_a, tmp_path)
    (load,) = loads(seen.b, "reader")
    assert blocks_bytes(seen.worker, list(load.gpu_blocks)) != seen.written
