"""Two vLLM engines in two processes on one host share a named disk tier's directory: engine B, running, is served
disk -> CPU -> GPU exactly the bytes engine A (a process of its own, `vllm_engines.ForkedEngine`) wrote back, its
scheduler having found them in the directory (`directory_lookup`); and a block torn by a kill -9 of A mid-write is
a miss for B, never visible to it under the block's name (`disk-block-whole`). Both engines run vLLM's real
Scheduler and the adapter's real worker role, traced and checked after every step and drained. Each rule has a
control that breaks it and is caught. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import pytest

pytest.importorskip("vllm")

from kvfsm.config import DiskTierConfig  # noqa: E402
from kvfsm.integrations.vllm.directory_lookup import DirectoryLookup  # noqa: E402
from kvfsm.integrations.vllm.master_lookup import KeyScheme  # noqa: E402
from kvfsm.mooncake.keys import KvNamespace  # noqa: E402
from kvfsm.testing.tier_mutants import publish_in_place  # noqa: E402
from kvfsm.tier_invariants import disk_block_whole  # noqa: E402
from kvfsm.tiers.blockfile import TEMPORARY, BlockFiles, DiskIo  # noqa: E402
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


def two_engines(tiered, engine_a, path: Path, in_place: bool = False, b_after_the_kill: bool = False
                ) -> SimpleNamespace:
    """B starts on the shared directory and steps once (its worker tells its scheduler the directory); A, forked
    then, writes PREFIX back, sends its bytes, and is killed half-way through writing TORN back. Then B serves a
    reader of PREFIX and a reader of TORN. With `b_after_the_kill` B starts only after A died (an engine restarted
    on A's directory). What `disk-block-whole` found through B's tier right after the kill, A's PREFIX bytes, B's
    driver and worker."""
    def start_b() -> tuple[Driver, AdapterWorker]:
        b, (worker,) = tiered(shared_disk(path))
        b.step()
        return b, worker

    if not b_after_the_kill:
        b, worker = start_b()
    half = FORK.Event()
    a = engine_a(shared_disk(path), torn_write(half, in_place))
    written = a.written()
    assert half.wait(WAIT_S), "A never half-wrote a block of TORN"
    a.kill()
    if b_after_the_kill:
        b, worker = start_b()
    torn = disk_block_whole(SimpleNamespace(tiers=worker.connector.worker_side.kvfsm.lower_tiers))  # type: ignore
    for req_id, prompt in (("reader", PREFIX + [9]), ("torn-reader", TORN + [9])):
        b.add(req_id, prompt)
        b.run(MAX_STEPS)
    return SimpleNamespace(torn=torn, written=written, b=b, worker=worker)


def loads(b: Driver, req_id: str) -> list[Any]:
    return [o for log in b.log for o in log.orders.loads if o.req_id == req_id]


@pytest.mark.parametrize("b_after_the_kill", [False, True], ids=["b-running", "b-restarted"])
def test_engine_b_is_served_from_the_shared_disk_exactly_the_bytes_engine_a_wrote_back(
        tiered, engine_a, tmp_path: Path, b_after_the_kill: bool) -> None:
    seen = two_engines(tiered, engine_a, tmp_path, b_after_the_kill=b_after_the_kill)
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


# --- a lookup never stalls the scheduler's step ------------------------------------------------------------------


def lookups_of_a_hung_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, timeout_s: float
                                ) -> tuple[list[int], float]:
    """A shared tier's directory whose every `stat` hangs until released: what lookups answer (two while the first
    check hangs, then the first after the release that is not a miss) and the longest of the first two."""
    released = threading.Event()
    monkeypatch.setattr(BlockFiles, "visible", lambda self, key: released.wait(WAIT_S))
    config = DiskTierConfig(path=tmp_path, capacity_bytes=1 << 20, model_id="tiny@1", kv_dtype="float16",
                            lookup_timeout_s=timeout_s)
    lookup = DirectoryLookup(config, num_workers=1)
    lookup.learn(0, KeyScheme(KvNamespace(model_id="tiny@1", dtype="float16", layout="kv-first", block_tokens=16),
                              block_bytes=4096))
    answers, longest = [], 0.0
    for _ in range(2):
        started = time.monotonic()
        answers.append(lookup.present([1, 2]))
        longest = max(longest, time.monotonic() - started)
    released.set()
    deadline = time.monotonic() + WAIT_S
    while (answer := lookup.present([1, 2])) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the hung check ends, then a fresh one answers
    answers.append(answer)
    lookup.close()
    return answers, longest


def test_a_directory_that_hangs_is_a_miss_within_the_lookup_bound_and_a_hit_once_it_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers, longest = lookups_of_a_hung_directory(tmp_path, monkeypatch, timeout_s=0.05)
    assert answers == [0, 0, 2] and longest < 0.5, (answers, longest)


def test_a_directory_lookup_that_gets_no_answer_warns_naming_its_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvfsm.tiers.bounded"):
        lookups_of_a_hung_directory(tmp_path, monkeypatch, timeout_s=0.05)
    assert caplog.messages[0] == "disk tier 'disk' directory lookup got no answer within 0.05s; counted as a miss"


def test_control_a_lookup_that_waits_on_the_directory_stalls_the_step_and_is_caught(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, longest = lookups_of_a_hung_directory(tmp_path, monkeypatch, timeout_s=0.6)
    assert longest >= 0.5


def test_each_rank_tells_the_scheduler_its_shared_directory_under_its_own_rank(tiered, tmp_path: Path) -> None:
    """Each rank writes its share of a block in a directory of its own: the scheduler's lookup waits until it knows
    every rank's, so each must arrive under its rank (two under one rank would leave the lookup waiting for ever)."""
    d, workers = tiered(shared_disk(tmp_path), ranks=2)
    d.step()  # the ranks' first reports carry their namespaces
    (tier,) = d.connector.scheduler_side.tier_index.tiers
    assert sorted(tier.master.ranks) == [0, 1]
