"""How the executor hands its work to a real GPU's driver: held row copies go out in order, one direction per
driver batch; block ids go up without the host waiting and stay in host memory until the kernel reading them ran
(with its control); a job's copies reach the driver in batches. Helpers are `test_gpu_executor`'s."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from kvfsm.executor import CudaDevice, transfer
from kvfsm.executor.block_ids import BlockIds
from kvfsm.executor.rows import RawRows, RowCopies
from test_gpu_executor import SLEEP_CYCLES, block, rig, settle

pytestmark = pytest.mark.gpu


def test_held_row_copies_go_out_in_order_one_direction_per_driver_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies inside one driver batch may run in any order, so a batch holds one direction only, in the order the
    copies were asked for, and a copy of another kind first sends what is held: a read of bytes just written
    then sees them."""
    batches: list[tuple[bool, int]] = []
    issue = RawRows.copy_many

    def logged(self: RawRows, dsts: list[int], srcs: list[int], sizes: list[int], to_device: bool,
               device: int) -> None:
        batches.append((to_device, len(sizes)))
        issue(self, dsts, srcs, sizes, to_device, device)

    monkeypatch.setattr(RawRows, "copy_many", logged)
    device = CudaDevice()
    host = device.pin_host(1 << 16)
    host[:4096] = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    gpu = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()  # zeroed on the compute stream, which the store stream does not wait for
    with torch.cuda.stream(device.streams["store"]), RowCopies(gpu.device, batched=True) as rows:
        for i in range(3):  # host -> device, a KiB each
            rows.copy(gpu, i * 1024, 1024, host, i * 1024, 1024, 1024, 1)
        for i in range(2):  # device -> host: reads what the first batch wrote
            rows.copy(host, 8192 + i * 1024, 1024, gpu, i * 1024, 1024, 1024, 1)
        rows.copy(host, 16384, 512, gpu, 0, 1024, 512, 2)  # two rows: a 2-D copy, never held
        rows.copy(gpu, 32768, 1024, host, 8192, 1024, 1024, 1)
    torch.cuda.synchronize()
    assert batches == [(True, 3), (False, 2), (True, 1)]
    assert torch.equal(host[8192:10240], host[:2048])
    assert torch.equal(host[16384:16896], host[:512]) and torch.equal(host[16896:17408], host[1024:1536])
    assert torch.equal(gpu[32768:33792].cpu(), host[:1024])
    with RowCopies(gpu.device, batched=True) as rows:  # the legacy default stream refuses batches: copies at once
        rows.copy(gpu, 40960, 1024, host, 0, 1024, 1024, 1)
    torch.cuda.synchronize()
    assert len(batches) == 3 and torch.equal(gpu[40960:41984].cpu(), host[:1024])
    device.unpin_host(host)


def test_block_ids_go_up_as_int64_without_the_host_waiting_for_their_stream() -> None:
    """Read by a kernel from pinned memory, launched without blocking: a blocking upload would hold the host until
    everything already on the stream ran (a step's earlier copies), which is the step's submission time."""
    stream = CudaDevice().streams["store"]
    ids = BlockIds(torch.device("cuda"))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy for ~10 ms
        busy = torch.cuda.Event()
        busy.record(stream)
        index, empty = ids([3, 1, 2]), ids([])
        assert not busy.query(), "the host waited for the stream"
    torch.cuda.synchronize()
    assert index.is_cuda and index.dtype == torch.int64 and index.tolist() == [3, 1, 2]
    assert empty.is_cuda and empty.dtype == torch.int64


class ForgetfulIds(BlockIds):
    """The control: host ids released as soon as the kernel that reads them is launched."""

    def __call__(self, ids: Sequence[int]) -> torch.Tensor:
        index = super().__call__(ids)
        self._kept.clear()
        return index


def ids_read_after_the_host_reused_pinned_memory(ids: BlockIds, trials: int = 8) -> int:
    """Trials in which a kernel queued behind ~10 ms of other work read back the ids it was given, though the host
    meanwhile allocated and filled pinned memory of the same size (what torch's pinned allocator hands out
    again once a pinned tensor is released)."""
    read = 0
    for trial in range(trials):
        want = torch.randperm(1024).tolist()
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(SLEEP_CYCLES)
            index = ids(want)
            scribbles = [torch.full((1024,), -1 - trial, dtype=torch.int64, pin_memory=True) for _ in range(4)]
        torch.cuda.synchronize()
        read += index.tolist() == want
        del scribbles
    return read


def test_block_ids_are_kept_in_host_memory_until_the_kernel_reading_them_ran() -> None:
    """A store's ids are read when its stream gets there, possibly after its forward pass: the host memory they
    are read from must not be handed out and overwritten before. The control releases it at once and reads
    another job's ids (or the scribbles) in most trials; kvfsm reads its own in every one."""
    assert ids_read_after_the_host_reused_pinned_memory(BlockIds(torch.device("cuda"))) == 8
    assert ids_read_after_the_host_reused_pinned_memory(ForgetfulIds(torch.device("cuda"))) <= 4


def test_block_ids_release_their_host_memory_once_read() -> None:
    """Kept host copies do not pile up: once the stream went past a kernel, the next upload lets its ids go."""
    ids = BlockIds(torch.device("cuda"))
    for _ in range(5):
        ids([1, 2, 3])
        torch.cuda.synchronize()
    assert ids.kept == 1


@pytest.fixture
def driver_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each batch of copies sent to the driver; a copy sent on its own fails the test."""
    batches: list[int] = []
    issue = RawRows.copy_many

    def logged(self: RawRows, dsts: list[int], srcs: list[int], sizes: list[int], to_device: bool,
               device: int) -> None:
        batches.append(len(sizes))
        issue(self, dsts, srcs, sizes, to_device, device)

    monkeypatch.setattr(RawRows, "copy_many", logged)
    monkeypatch.setattr(RawRows, "copy", lambda *_: pytest.fail("a copy went to the driver on its own"))
    return batches


def test_a_dma_only_jobs_copies_go_to_the_driver_in_batches(driver_batches: list[int]) -> None:
    """A cross-layer store of scattered blocks is a copy per block: sent as a few driver batches, not a call
    each (the host's submission otherwise outlasts the copies when both directions move)."""
    device, caches, pool, transfers = rig("cross-layer", 1, "cross-layer")
    sources = [9, 3, 40, 17, 5, 28, 60, 1, 33, 12]
    expected = [block(caches, b).clone() for b in sources]
    torch.cuda.synchronize()
    transfers.store(sources, range(10))
    settle(device, "store")
    assert sum(driver_batches) == 10 * len(caches.planes) and len(driver_batches) < 10  # a copy per block, tensor
    assert all(torch.equal(pool.slot(i).cuda(), want) for i, want in enumerate(expected))
    pool.close()


@pytest.mark.parametrize("layer_segments", [False, True])
def test_a_staged_job_s_copies_to_scattered_slots_go_to_the_driver_in_batches(
        driver_batches: list[int], layer_segments: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of a chunk (or of a layer segment) whose host slots are scattered are a one-row copy each: sent as
    driver batches (one call each ran a 2 MiB copy at 0.88 of the ceiling, batches at 0.98). A load from slots
    this scattered goes out whole (`MIN_LAYER_COPY_BYTES`) unless the minimum is lifted, as here."""
    monkeypatch.setattr(transfer, "MIN_LAYER_COPY_BYTES", 0)
    device, caches, pool, transfers = rig("kv-first", 1, "staged-gather")
    sources, slots, targets = [9, 3, 40, 17, 5, 28], [30, 2, 17, 8, 25, 11], [50, 7, 21, 44, 2, 36]
    expected = [block(caches, b).clone() for b in sources]
    torch.cuda.synchronize()
    transfers.store(sources, slots)
    settle(device, "store")
    if layer_segments:
        segments = transfers.load_segments(slots, targets)
        for segment in range(transfers.num_segments):
            segments.enqueue(segment, f"layer {segment}")
    else:
        transfers.load(slots, targets)
    settle(device, "load")
    copies = len(sources) * (1 + (transfers.num_segments if layer_segments else 1))
    assert sum(driver_batches) == copies and len(driver_batches) < copies
    assert all(torch.equal(block(caches, b), want) for b, want in zip(targets, expected))
    pool.close()

