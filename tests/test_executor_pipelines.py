"""Store pipelines and layer segments on a `SimDevice`: how a job is cut into chunks of a staging slot, what each
piece logs and counts, and which piece waits for its stream (the first chunk of a pipeline, every layer of a
per-layer store, the first layer of a load) — so copies keep stream order without waiting twice.
"""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from kvfsm.executor import mechanisms
from kvfsm.executor.block_ids import BlockIds
from kvfsm.executor.lanes import InlineLanes, Step
from test_executor_transfer import block, make, stored


def test_a_direct_copy_store_pipeline_is_one_chunk_holding_the_whole_job() -> None:
    """A mechanism without staging copies a job in one go, so its pipeline is a single chunk of every block."""
    device, caches, pool, transfers = make("kv-first", 2, "copy-per-block")
    sources, slots = [5, 0, 9, 3], [6, 2]
    expected = [block(caches, b).clone() for b in sources]
    chunks = transfers.store_chunks(sources, slots)
    assert (chunks.count, chunks.ends, chunks.nbytes(0)) == (1, (0,), 4 * caches.gpu_block_bytes)
    chunks.enqueue(0, "store job 1 chunk 0")
    device.run_until_idle()
    assert all(torch.equal(stored(caches, pool, slots[i // 2], i % 2), expected[i]) for i in range(4))


@pytest.mark.parametrize("mechanism", ["staged-gather", "copy-per-block"])
def test_an_empty_store_is_one_chunk_of_nothing_that_ends_its_job(mechanism: str) -> None:
    """A job ends after the chunk `ends` names: for a store of no blocks that must be the one chunk there is,
    or the job's event would never be recorded and it would never finish."""
    _, _, _, transfers = make("kv-first", 1, mechanism)
    chunks = transfers.store_chunks([], [])
    assert (chunks.count, chunks.ends, chunks.nbytes(0)) == (1, (0,), 0)


def test_a_staged_store_pipeline_is_cut_into_chunks_of_a_staging_slot_each_counting_its_bytes() -> None:
    _, caches, _, transfers = make("kv-first", 2, staging_blocks=3)
    chunks = transfers.store_chunks([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3])
    block_bytes = caches.gpu_block_bytes
    assert chunks.count == 3
    assert [chunks.nbytes(chunk) for chunk in range(chunks.count)] == [3 * block_bytes] * 2 + [2 * block_bytes]
    assert chunks.ends == (2,)


def test_each_chunk_of_a_store_pipeline_logs_only_its_own_blocks_and_slots_under_its_label() -> None:
    """A chunk is its own device operation: what it reads and writes is judged on its own by the ordering
    invariants, so it must name exactly the GPU blocks it gathers and the CPU slots its blocks land in."""
    device, _, _, transfers = make("kv-first", 2, staging_blocks=3)
    chunks = transfers.store_chunks([8, 1, 2, 11, 4, 5, 6, 7], [4, 0, 7, 3])
    for chunk in range(chunks.count):
        chunks.enqueue(chunk, f"store job 9 chunk {chunk}")
    device.run_until_idle()
    logged = {(a.label, a.actor, a.mode, a.space, a.block) for a in device.accesses}
    expected = {0: ((8, 1, 2), (4, 0)), 1: ((11, 4, 5), (0, 7)), 2: ((6, 7), (3,))}
    assert logged == {
        (f"store job 9 chunk {chunk}", "store", mode, space, b)
        for chunk, (blocks, slots) in expected.items()
        for mode, space, ids in (("read", "gpu", blocks), ("write", "cpu", slots)) for b in ids}


def _jobs(k: int, slots_per_job: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Stores of `slots_per_job` CPU slots each, on scattered GPU blocks and slots no two of them share."""
    free_blocks, free_slots = iter([10, 3, 7, 0, 5, 8, 2, 11]), iter([6, 1, 4, 2])
    jobs = []
    for n in slots_per_job:
        slots = [next(free_slots) for _ in range(n)]
        jobs.append(([next(free_blocks) for _ in range(k * n)], slots))
    return jobs


@pytest.mark.parametrize(("mechanism", "k", "staging_blocks", "slots_per_job"), [
    ("staged-gather", 2, 3, (2, 1, 1)), ("staged-gather", 1, 1, (1, 2, 1)), ("copy-per-block", 2, 3, (2, 1, 1))])
def test_merged_stores_end_each_job_at_the_chunk_that_stores_its_last_block(
        mechanism: str, k: int, staging_blocks: int, slots_per_job: tuple[int, ...]) -> None:
    """The connector reports a merged store's job done after chunk `ends[j]`: that chunk must be the one that
    copies the job's last block, and every job's blocks must land in its own slots."""
    device, caches, pool, transfers = make("kv-first", k, mechanism, staging_blocks=staging_blocks)
    jobs = _jobs(k, slots_per_job)
    expected = {b: block(caches, b).clone() for blocks, _ in jobs for b in blocks}
    chunks = transfers.merge_chunks([transfers.store_chunks(blocks, slots) for blocks, slots in jobs])
    for chunk in range(chunks.count):
        chunks.enqueue(chunk, f"chunk {chunk}")
    device.run_until_idle()
    reader = {a.block: a.label for a in device.accesses if a.mode == "read"}
    assert [reader[blocks[-1]] for blocks, _ in jobs] == [f"chunk {end}" for end in chunks.ends]
    assert all(torch.equal(stored(caches, pool, slots[i // k], i % k), expected[b])
               for blocks, slots in jobs for i, b in enumerate(blocks))


def test_merged_direct_copy_stores_are_a_chunk_per_job_so_each_job_ends_behind_its_own_copies() -> None:
    """Without staging, a chunk of the whole step would end every job only after the step's last copy: the
    engine would hear of (and unfence) the first job's blocks a whole step of copies late."""
    _, caches, _, transfers = make("kv-first", 2, "copy-per-block")
    jobs = _jobs(2, (2, 1, 1))
    chunks = transfers.merge_chunks([transfers.store_chunks(blocks, slots) for blocks, slots in jobs])
    assert (chunks.count, chunks.ends) == (3, (0, 1, 2))
    assert [chunks.nbytes(chunk) for chunk in range(3)] == [n * caches.gpu_block_bytes for n in (4, 2, 2)]


def test_a_layer_segment_counts_the_bytes_of_its_layer_in_every_block() -> None:
    _, caches, _, transfers = make("mla", 1)
    segments = transfers.load_segments([0, 1, 2], [3, 4, 5])
    sizes = [segments.nbytes(segment) for segment in range(transfers.num_segments)]
    assert sizes == [3 * plane.block_bytes for plane in caches.planes]
    assert sum(sizes) == 3 * caches.gpu_block_bytes


class JoinLog(InlineLanes):
    """Inline lanes that note, for every run, whether it first waited for its stream (`join`)."""

    def __init__(self, joins: list[bool]) -> None:
        self.joins = joins

    def run(self, steps: Sequence[Step], join: bool = True) -> None:
        self.joins.append(join)
        super().run(steps, join)


@pytest.fixture
def joins(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The `join` of every staged run, in the order the copies ran."""
    log: list[bool] = []
    monkeypatch.setattr(mechanisms, "lanes_for", lambda device: JoinLog(log))
    return log


def test_only_the_first_chunk_of_a_store_pipeline_waits_for_the_store_stream(joins: list[bool]) -> None:
    device, _, _, transfers = make("kv-first", 2, staging_blocks=3)
    chunks = transfers.store_chunks([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3])
    for chunk in range(chunks.count):
        chunks.enqueue(chunk, f"chunk {chunk}")
    device.run_until_idle()
    assert joins == [True, False, False]


def send_every_layer(direction: str) -> int:
    """Enqueue and run every layer segment of a two-block job in `direction`; returns the number of layers."""
    device, _, _, transfers = make("kv-first", 1)
    if direction == "store":
        segments = transfers.store_segments([1, 2], [3, 4])
    else:
        segments = transfers.load_segments([3, 4], [1, 2])
    for segment in range(transfers.num_segments):
        segments.enqueue(segment, f"layer {segment}")
    device.run_until_idle()
    return transfers.num_segments


def test_every_store_layer_segment_waits_for_the_store_stream(joins: list[bool]) -> None:
    """Each layer of a per-layer store goes out behind its own compute event, so none may skip the wait."""
    layers = send_every_layer("store")
    assert joins == [True] * layers


def test_only_the_first_layer_segment_of_a_load_waits_for_the_load_stream(joins: list[bool]) -> None:
    layers = send_every_layer("load")
    assert joins == [True] + [False] * (layers - 1)


@pytest.fixture
def uploads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Every GPU block index uploaded: on CUDA each is a kernel reading pinned host memory, launched by the host."""
    uploaded: list[tuple[int, ...]] = []
    upload = BlockIds.__call__

    def counted(self: BlockIds, ids: Sequence[int]) -> torch.Tensor:
        uploaded.append(tuple(ids))
        return upload(self, ids)

    monkeypatch.setattr(BlockIds, "__call__", counted)
    return uploaded


def test_a_store_pipeline_uploads_its_gpu_block_index_once(uploads: list[tuple[int, ...]]) -> None:
    """A pipeline's chunks share one index upload."""
    device, _, _, transfers = make("kv-first", 2, staging_blocks=3)
    chunks = transfers.store_chunks([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3])
    for chunk in range(chunks.count):
        chunks.enqueue(chunk, f"chunk {chunk}")
    device.run_until_idle()
    assert uploads == [(0, 1, 2, 3, 4, 5, 6, 7)]
