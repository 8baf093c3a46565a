"""What each transfer mechanism issues: the runs it coalesces, the chunks a staging slot cuts a job into, the copies
per run, and byte-exact round trips of whole jobs and of layer segments through the smallest staging slot."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from kvfsm.executor import HostPool, KVCaches, SimDevice, Transfers, register_kv_caches
from kvfsm.executor import gather, graphs, mechanisms
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.block_ids import BlockIds
from kvfsm.executor.choice import COPY_ENGINE_MIN_PIECE, resolve
from kvfsm.executor.mechanisms import runs
from kvfsm.executor.rows import RowCopies
from test_executor_pipelines import JoinLog, uploads  # noqa: F401 (a fixture)
from test_executor_transfer import CASES, NUM_BLOCKS, block, make


def one_tensor(layout: str, mechanism: str) -> tuple[SimDevice, KVCaches, HostPool, Transfers]:
    """Random caches of a single registered tensor and a pool, with a staging slot of one GPU block."""
    device = SimDevice()
    tensors, groups = allocate_kv_caches(layout, 1, NUM_BLOCKS, 2, 2, 4, torch.bfloat16, "cpu")
    for t in tensors.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                generator=torch.Generator().manual_seed(3)))
    caches = register_kv_caches(tensors, layout, groups)
    pool = HostPool(device, 8, caches.gpu_block_bytes)
    return device, caches, pool, Transfers(device, caches, pool, 1, mechanism, staging_bytes=caches.gpu_block_bytes)


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(bytes per row, rows) of every row copy a mechanism issues, in order."""
    log: list[tuple[int, int]] = []
    issue = RowCopies.copy

    def logged(self: RowCopies, dst: torch.Tensor, dst_offset: int, dst_pitch: int, src: torch.Tensor,
               src_offset: int, src_pitch: int, width: int, height: int) -> None:
        log.append((width, height))
        issue(self, dst, dst_offset, dst_pitch, src, src_offset, src_pitch, width, height)

    monkeypatch.setattr(RowCopies, "copy", logged)
    return log


def test_a_run_is_consecutive_blocks_whose_offsets_advance_by_the_stride_together() -> None:
    assert list(runs([3, 4, 5, 9, 10], [0, 8, 16, 40, 56], 8)) == [(0, 3, 0, 3), (3, 9, 40, 1), (4, 10, 56, 1)]


def test_a_block_index_is_int64_even_for_no_blocks() -> None:
    """Index kernels refuse any other dtype, and an empty list would otherwise become a float tensor."""
    for ids in ([], [4, 1]):
        index = BlockIds(torch.device("cpu"))(ids)
        assert index.dtype == torch.int64 and index.tolist() == ids


def test_auto_moves_blocks_by_dma_alone_from_exactly_the_minimum_piece_size() -> None:
    tensors, groups = allocate_kv_caches("cross-layer", 16, 2, 16, 8, 128, torch.bfloat16, "cpu")  # 1 MiB blocks
    caches = register_kv_caches(tensors, "cross-layer", groups)
    assert caches.gpu_block_bytes == COPY_ENGINE_MIN_PIECE
    assert resolve("auto", caches) == "cross-layer"


@pytest.mark.parametrize("staging_blocks", [1, 4])
@pytest.mark.parametrize("mechanism", ["staged-gather", "fused-gather", "staged-copy"])
def test_a_staged_store_pipeline_chunk_is_as_many_blocks_as_a_staging_slot_holds(mechanism: str,
                                                                               staging_blocks: int) -> None:
    _, caches, _, transfers = make("blocks-first", 1, mechanism, staging_blocks=staging_blocks)
    chunks = transfers.store_chunks(range(6), range(6))
    assert chunks.count == -(-6 // staging_blocks)
    assert chunks.nbytes(0) == staging_blocks * caches.gpu_block_bytes


@pytest.mark.parametrize(("module", "builder", "mechanism", "built", "warning"), [
    (gather, "PieceGather", "fused-gather", "_one_launch",
     "one-launch gathers unavailable, gathering one plane at a time: RuntimeError: refused"),
    (graphs, "SlotGraphs", "staged-gather", "_graphs",
     "graph launches unavailable, launching each plane's gather and scatter from the host: RuntimeError: refused")])
def test_a_chunk_launch_that_cannot_be_built_falls_back_to_a_launch_per_plane_and_says_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, module: object, builder: str,
        mechanism: str, built: str, warning: str) -> None:
    """A GPU without a compiler for Triton, or a driver that refuses graph capture, still moves blocks: by a launch
    per plane from the host, with a warning that names what failed, and every byte lands both ways."""
    def refused(*_: object) -> None:
        raise RuntimeError("refused")

    monkeypatch.setattr(module, "available", lambda device: True)
    monkeypatch.setattr(module, builder, refused)
    device, caches, _, transfers = make("kv-first", 1, mechanism, staging_blocks=3)
    assert getattr(transfers._mechanism, built) is None
    assert [record.getMessage() for record in caplog.records] == [warning]
    expected = [block(caches, b).clone() for b in (7, 2, 9, 0)]
    transfers.store([7, 2, 9, 0], range(4))
    transfers.load(range(4), [1, 3, 5, 8])
    device.run_until_idle()
    assert all(torch.equal(block(caches, b), want) for b, want in zip([1, 3, 5, 8], expected))


def test_staged_gather_keeps_a_launch_per_plane_where_one_launch_could_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """One launch per chunk is fused-gather's choice: it took more of a concurrent kernel's time, so staged-gather
    (what `auto` picks for per-layer caches) never builds it."""
    built: list[object] = []
    monkeypatch.setattr(gather, "available", lambda device: True)
    monkeypatch.setattr(gather, "PieceGather", lambda *args: built.append(args))
    _, _, _, transfers = make("kv-first", 1, "staged-gather")
    assert transfers._mechanism._one_launch is None and built == []


@pytest.mark.parametrize(("layout", "mechanism", "captured"), [
    ("kv-first", "staged-gather", True), ("kv-first", "fused-gather", False), ("cross-layer", "staged-copy", False)])
def test_only_gathers_and_scatters_launched_a_plane_at_a_time_are_captured_as_graphs(
        monkeypatch: pytest.MonkeyPatch, layout: str, mechanism: str, captured: bool) -> None:
    """fused-gather's one launch needs no graph, and staged-copy gathers by copies, not kernels."""
    built: list[int] = []
    monkeypatch.setattr(graphs, "available", lambda device: True)
    monkeypatch.setattr(gather, "available", lambda device: True)
    monkeypatch.setattr(gather, "PieceGather", lambda *args: lambda index, slot: None)
    monkeypatch.setattr(graphs, "SlotGraphs", lambda launches, slots, chunk, device: built.append(chunk))
    make(layout, 1, mechanism, staging_blocks=3)
    assert built == ([3, 3] if captured else [])


def test_staged_gather_off_a_gpu_captures_nothing() -> None:
    assert make("kv-first", 1, "staged-gather")[3]._mechanism._graphs is None


class Replayed:
    """`graphs.SlotGraphs` as the CPU can run it: the launches run once per slot and pacing when made, as capture's
    first runs do, and again on each replay, which is logged as (direction, blocks, paced)."""

    def __init__(self, log: list[tuple[str, int, bool]], direction: str, launches: graphs.Launches, slots: int,
                 chunk: int, device: torch.device) -> None:
        for slot in range(slots):
            for pause_ns in (0, graphs.PACE_NS):
                launches(torch.zeros(chunk, dtype=torch.int64, device=device), slot, pause_ns)
        self._log, self._direction, self._launches = log, direction, launches

    def __call__(self, index: torch.Tensor, slot: int, paced: bool) -> None:
        self._log.append((self._direction, len(index), paced))
        self._launches(index, slot, 0)


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, bool]]:
    """Each replay of a captured chunk, with graph capture (and its pauses) stood in for on the CPU."""
    log: list[tuple[str, int, bool]] = []
    made = iter(("store", "load"))
    monkeypatch.setattr(graphs, "available", lambda device: True)
    monkeypatch.setattr(graphs, "SlotGraphs", lambda *args: Replayed(log, next(made), *args))
    monkeypatch.setattr(graphs, "pause", lambda ns: None)
    return log


def test_capturing_staged_gather_s_launches_leaves_every_cached_block_as_it_was(
        replays: list[tuple[str, int, bool]]) -> None:
    """Capture runs each launch once: the scatters then write block 0, which must get its own bytes back."""
    tensors, groups = allocate_kv_caches("kv-first", 4, NUM_BLOCKS, 2, 2, 4, torch.bfloat16, "cpu")
    for tensor in tensors.values():
        tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8))
    before = {name: tensor.view(torch.uint8).clone() for name, tensor in tensors.items()}
    caches = register_kv_caches(tensors, "kv-first", groups)
    Transfers(SimDevice(), caches, HostPool(SimDevice(), 8, caches.gpu_block_bytes), 1, "staged-gather",
              staging_bytes=3 * caches.gpu_block_bytes)
    assert all(torch.equal(tensors[name].view(torch.uint8), bytes_) for name, bytes_ in before.items())


def test_full_chunks_replay_their_captured_launches_and_a_shorter_one_launches_from_the_host(
        replays: list[tuple[str, int, bool]]) -> None:
    """Replays are paced except where the copy engine waits on them: a job's first gather, its last scatter."""
    device, caches, _, transfers = make("kv-first", 1, "staged-gather", staging_blocks=2)
    expected = [block(caches, b).clone() for b in (7, 2, 9, 0, 4)]
    transfers.store([7, 2, 9, 0, 4], range(5))
    transfers.load(range(4), [1, 3, 6, 8])
    transfers.load(range(5), [1, 3, 6, 8, 10])  # its last chunk is short: it launches, the full ones stay paced
    device.run_until_idle()
    assert replays == [("store", 2, False), ("store", 2, True), ("load", 2, True), ("load", 2, False),
                       ("load", 2, True), ("load", 2, True)]
    assert all(torch.equal(block(caches, b), want) for b, want in zip([1, 3, 6, 8, 10], expected))


def test_only_a_store_pipeline_s_first_chunk_replays_its_gathers_back_to_back(
        replays: list[tuple[str, int, bool]]) -> None:
    """Later chunks of a pipeline are gathered while the copy engine moves the ones before: paced."""
    device, _, _, transfers = make("kv-first", 1, "staged-gather", staging_blocks=2)
    chunks = transfers.store_chunks([7, 2, 9, 0, 4, 11], range(6))
    for chunk in range(chunks.count):
        chunks.enqueue(chunk, f"chunk {chunk}")
    device.run_until_idle()
    assert replays == [("store", 2, False), ("store", 2, True), ("store", 2, True)]


def test_a_direct_copy_store_pipeline_uploads_no_gpu_block_index(uploads: list[tuple[int, ...]]) -> None:
    """Only the gathering mechanisms index blocks on the device; for a direct copy the upload would be wasted."""
    device, _, _, transfers = make("blocks-first", 1, "copy-per-block")
    chunks = transfers.store_chunks([0, 1, 2], [0, 1, 2])
    chunks.enqueue(0, "chunk 0")
    device.run_until_idle()
    assert uploads == []


@pytest.mark.parametrize(("layout", "mechanism"), [("kv-first", "copy-per-block"), ("cross-layer", "cross-layer")])
def test_a_direct_copy_load_uploads_no_gpu_block_index(layout: str, mechanism: str,
                                                       uploads: list[tuple[int, ...]]) -> None:
    """A load's layer segments copy from byte offsets too: an upload would only delay its first copy."""
    device, _, _, transfers = make(layout, 1, mechanism)
    segments = transfers.load_segments([3, 4], [1, 2])
    for segment in range(transfers.num_segments):
        segments.enqueue(segment, f"layer {segment}")
    device.run_until_idle()
    assert uploads == []


def test_a_whole_staged_store_or_load_waits_for_its_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    joins: list[bool] = []
    monkeypatch.setattr(mechanisms, "lanes_for", lambda device: JoinLog(joins))
    device, _, _, transfers = make("kv-first", 1, "staged-gather")
    transfers.store([1, 2], [3, 4])
    transfers.load([3, 4], [5, 6])
    device.run_until_idle()
    assert joins == [True, True]


def test_staged_gather_issues_one_dma_per_chunk_of_consecutive_host_blocks(copies: list[tuple[int, int]]) -> None:
    device, caches, _, transfers = make("kv-first", 1, "staged-gather", staging_blocks=3)
    transfers.store([7, 2, 9, 0, 5, 11], range(6))
    device.run_until_idle()
    assert copies == [(3 * caches.gpu_block_bytes, 1)] * 2


def test_staged_copy_gathers_a_run_of_consecutive_gpu_blocks_with_one_copy_per_tensor(
        copies: list[tuple[int, int]]) -> None:
    device, caches, _, transfers = make("blocks-first", 1, "staged-copy", staging_blocks=4)
    transfers.store([2, 3, 4, 5], [0, 1, 2, 3])
    device.run_until_idle()
    gathers = [(plane.block_bytes, 4) for plane in caches.planes]
    assert copies == gathers + [(4 * caches.gpu_block_bytes, 1)]


@pytest.mark.parametrize(("layout", "mechanism"), CASES)
def test_a_job_of_one_registered_tensor_round_trips_every_byte(layout: str, mechanism: str) -> None:
    device, caches, pool, transfers = one_tensor(layout, mechanism)
    sources, slots = [4, 5, 6, 1], [2, 3, 4, 0]
    expected = [block(caches, b).clone() for b in sources]
    transfers.store(sources, slots)
    device.run_until_idle()
    assert all(torch.equal(pool.slot(s), e) for s, e in zip(slots, expected))
    targets = [8, 9, 10, 3]
    transfers.poison_gpu(targets, "load")
    transfers.load(slots, targets)
    device.run_until_idle()
    assert all(torch.equal(block(caches, b), e) for b, e in zip(targets, expected))


def store_and_load_by_segments(device: SimDevice, transfers: Transfers, sources: Sequence[int],
                               slots: Sequence[int], targets: Sequence[int]) -> None:
    stores = transfers.store_segments(sources, slots)
    for segment in range(transfers.num_segments):
        stores.enqueue(segment, f"store layer {segment}")
    device.run_until_idle()
    transfers.poison_gpu(targets, "load")
    loads = transfers.load_segments(slots, targets)
    for segment in range(transfers.num_segments):
        loads.enqueue(segment, f"load layer {segment}")
    device.run_until_idle()


@pytest.mark.parametrize("one", [True, False], ids=["one-tensor", "four-layers"])
@pytest.mark.parametrize(("layout", "mechanism"), CASES)
def test_layer_segments_round_trip_every_byte_through_a_one_block_staging_slot(layout: str, mechanism: str,
                                                                               one: bool) -> None:
    device, caches, pool, transfers = (one_tensor(layout, mechanism) if one
                                       else make(layout, 1, mechanism, staging_blocks=1))
    sources, slots, targets = [4, 5, 6, 1, 2, 3], [2, 3, 4, 0, 6, 7], [8, 9, 10, 11, 0, 7]
    expected = [block(caches, b).clone() for b in sources]
    store_and_load_by_segments(device, transfers, sources, slots, targets)
    assert all(torch.equal(pool.slot(s), e) for s, e in zip(slots, expected))
    assert all(torch.equal(block(caches, b), e) for b, e in zip(targets, expected))
