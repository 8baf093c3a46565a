"""Row copies as the CUDA driver sees them: what a batch of one-row copies asks the driver, and what happens to a
batch it refuses.

The batched copies call the driver through ctypes, so on the CPU the driver is replaced by `FakeDriver`, which
answers each call with a chosen CUresult and keeps the attributes every batch was built with; everything above
the driver call (`RawRows`, `RowCopies`) is kvfsm's own code. The `gpu` test makes the real driver refuse.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvfsm.executor import rows
from kvfsm.executor.rows import FIRST_BATCH, RowCopies, RowCopyError

SRC_ACCESS_ORDER_STREAM, SRC_ACCESS_ORDER_ANY = 1, 3
"""`CUmemcpySrcAccessOrder`: the source is read when the stream reaches the copy, or whenever the driver likes."""
INVALID_VALUE = 1  # CUresult CUDA_ERROR_INVALID_VALUE
LOCATION_DEVICE, LOCATION_HOST = 1, 2  # CUmemLocationType
PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
ROW = 64


@dataclass
class FakeDriver:
    """The driver calls `RawRows` makes, answering `result`; `batches` keeps each batch's attributes, `calls` the
    rest of each batch call (addresses, sizes, count, attribute index and count, stream)."""

    result: int = 0
    batches: list[rows._MemcpyAttributes] = field(default_factory=list)
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    copies: list[tuple[Any, ...]] = field(default_factory=list)
    """Each 2-D copy: (source, destination) as (memory type, host address, device address, pitch), the width,
    the height and the stream."""

    def cuMemcpy2DAsync_v2(self, copy: Any, stream: Any) -> int:  # noqa: N802 (the driver's name)
        c = copy._obj
        self.copies.append(((c.srcMemoryType, c.srcHost, c.srcDevice, c.srcPitch),
                            (c.dstMemoryType, c.dstHost, c.dstDevice, c.dstPitch), c.WidthInBytes, c.Height,
                            stream.value))
        return self.result

    def batch(self, dsts: Any, srcs: Any, sizes: Any, count: int, attributes: Any, attribute_index: Any,
              num_attributes: int, stream: Any) -> int:
        self.batches.append(rows._MemcpyAttributes.from_buffer_copy(attributes._obj))
        self.calls.append((list(dsts), list(srcs), list(sizes), count, attribute_index._obj.value, num_attributes,
                           stream.value))
        return self.result


@dataclass(frozen=True)
class Buffer:
    """What `RowCopies` reads of a tensor to send it to the driver: its side and its address."""

    is_cuda: bool
    address: int

    def data_ptr(self) -> int:
        return self.address


GPU, HOST = Buffer(True, 1 << 40), Buffer(False, 1 << 20)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    """Row copies on `cuda:0` whose driver is a `FakeDriver`, on a stream that takes batches."""
    fake = FakeDriver()
    monkeypatch.setattr(rows, "_driver", lambda: fake)
    monkeypatch.setattr(rows, "_batch_issue", lambda: fake.batch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=7))
    return fake


def copy_rows(count: int, to_device: bool, device: int = 0) -> None:
    """`count` one-row copies in one direction between the host and GPU `device`, held and sent as batches."""
    dst, src = (GPU, HOST) if to_device else (HOST, GPU)
    with RowCopies(torch.device("cuda", device), batched=True) as copies:
        for i in range(count):
            copies.copy(dst, i * ROW, ROW, src, i * ROW, ROW, ROW, 1)


# a refused batch ----------------------------------------------------------------------------------------------


def test_a_batch_the_driver_refused_is_not_issued_again_on_exit(driver: FakeDriver) -> None:
    """The first batch fills, is refused and raises; leaving the context sends nothing more."""
    driver.result = INVALID_VALUE
    with pytest.raises(RowCopyError, match=f"cuMemcpyBatchAsync of {FIRST_BATCH} copies \\({FIRST_BATCH * ROW} "
                                           f"bytes\\) failed with CUresult {INVALID_VALUE}"):
        copy_rows(FIRST_BATCH, to_device=True)
    assert len(driver.batches) == 1


@pytest.mark.gpu
def test_a_batch_the_real_driver_refused_is_not_issued_again_on_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real driver refuses a batch on the legacy default stream (CUDA_ERROR_INVALID_VALUE): each batch is
    sent there, once, and nothing of it lands."""
    issue = rows._batch_issue()
    if issue is None:
        pytest.skip("this driver has no cuMemcpyBatchAsync")
    sent: list[int] = []

    def on_the_legacy_stream(*args: Any) -> int:
        sent.append(args[3])
        return int(issue(*args[:-1], None))

    monkeypatch.setattr(rows, "_batch_issue", lambda: on_the_legacy_stream)
    host = torch.arange(FIRST_BATCH * ROW, dtype=torch.int64).to(torch.uint8).pin_memory()
    gpu = torch.zeros(FIRST_BATCH * ROW, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()), pytest.raises(RowCopyError, match="CUresult 1"):
        with RowCopies(gpu.device, batched=True) as copies:
            for i in range(FIRST_BATCH):
                copies.copy(gpu, i * ROW, ROW, host, i * ROW, ROW, ROW, 1)
    torch.cuda.synchronize()
    assert sent == [FIRST_BATCH]
    assert not gpu.any()


# what a batch asks of the driver ------------------------------------------------------------------------------


@pytest.mark.parametrize("to_device", [False, True], ids=["store", "load"])
def test_a_batch_names_its_copies_where_each_side_lives_and_the_copy_engines(driver: FakeDriver,
                                                                            to_device: bool) -> None:
    """The driver takes a batch's copies from three arrays and one set of attributes for all of them, on kvfsm's
    stream; it picks the copy path from the locations the attributes name (the host, and the GPU the copies
    touch: GPU 1 here) and leaves the SMs to compute only when the flag asks it to."""
    copy_rows(FIRST_BATCH, to_device, device=1)
    dst, src = (GPU, HOST) if to_device else (HOST, GPU)
    offsets = [i * ROW for i in range(FIRST_BATCH)]
    assert driver.calls == [([dst.address + o for o in offsets], [src.address + o for o in offsets],
                             [ROW] * FIRST_BATCH, FIRST_BATCH, 0, 1, 7)]
    (batch,) = driver.batches
    host, gpu = (LOCATION_HOST, 0), (LOCATION_DEVICE, 1)
    assert ((batch.srcLocHint.type, batch.srcLocHint.id), (batch.dstLocHint.type, batch.dstLocHint.id)) == \
        ((host, gpu) if to_device else (gpu, host))
    assert batch.flags == PREFER_OVERLAP_WITH_COMPUTE


# the source's access order -------------------------------------------------------------------------------------


def batches_read_their_source_in_stream_order(driver: FakeDriver, to_device: bool) -> bool:
    """Whether every batch a job of one-row copies sent asked the driver to read its source in stream order."""
    copy_rows(3 * FIRST_BATCH, to_device)
    assert driver.batches, "no batch went to the driver"
    return all(batch.srcAccessOrder == SRC_ACCESS_ORDER_STREAM for batch in driver.batches)


@pytest.mark.parametrize("to_device", [False, True], ids=["store", "load"])
def test_store_after_compute_batched_copies_read_their_source_in_stream_order(driver: FakeDriver,
                                                                              to_device: bool) -> None:
    """A store's batch reads KV that compute wrote, behind the wait on the compute-done event. With
    `srcAccessOrder=ANY` the copy engine may read the source before that wait is passed, so the CPU block
    gets stale KV (the seeds' SimpleCPUOffloadConnector fix, vLLM #46278). Loads read their host slots in stream
    order too: kvfsm passes one access order for both directions, and a change to either must fail a test."""
    assert batches_read_their_source_in_stream_order(driver, to_device)


def test_a_batch_built_to_read_its_source_in_any_order_is_caught(driver: FakeDriver,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same copies with the access order the fix removed."""
    monkeypatch.setattr(rows, "_ACCESS_IN_STREAM_ORDER", SRC_ACCESS_ORDER_ANY)
    assert not batches_read_their_source_in_stream_order(driver, to_device=False)


def test_the_batch_attributes_are_laid_out_as_the_drivers_cumemcpyattributes() -> None:
    """The driver reads `CUmemcpyAttributes` by offset (an access order, two (type, id) locations, a flags word):
    a field moved in the ctypes struct would make it read another field as the access order, which the test
    above, reading by name, cannot see."""
    layout = {name: getattr(rows._MemcpyAttributes, name).offset for name, _ in rows._MemcpyAttributes._fields_}
    assert layout == {"srcAccessOrder": 0, "srcLocHint": 4, "dstLocHint": 12, "flags": 20}
    assert ctypes.sizeof(rows._MemcpyAttributes) == 24


# what is held for a batch and what goes to the driver at once ---------------------------------------------------

MEMORY_HOST, MEMORY_DEVICE = 1, 2  # CUmemorytype


def test_a_copy_of_several_rows_goes_to_the_driver_at_once_as_one_2d_copy(driver: FakeDriver) -> None:
    """Only one-row copies between host and GPU are held for a batch; a copy of several rows is issued at once,
    each side where it lives, its offsets added to the buffers' addresses."""
    with RowCopies(torch.device("cuda", 0), batched=True) as copies:
        copies.copy(GPU, 3 * ROW, 2 * ROW, HOST, ROW, 4 * ROW, ROW, 2)
        assert driver.copies == [((MEMORY_HOST, HOST.address + ROW, 0, 4 * ROW),
                                  (MEMORY_DEVICE, None, GPU.address + 3 * ROW, 2 * ROW), ROW, 2, 7)]
    assert not driver.batches


def test_unbatched_copies_go_to_the_driver_one_by_one(driver: FakeDriver) -> None:
    with RowCopies(torch.device("cuda", 0)) as copies:
        copies.copy(HOST, 0, ROW, GPU, ROW, ROW, ROW, 1)
        assert driver.copies == [((MEMORY_DEVICE, None, GPU.address + ROW, ROW), (MEMORY_HOST, HOST.address, 0, ROW),
                                  ROW, 1, 7)]
    assert not driver.batches


def test_the_legacy_default_stream_gets_no_batches(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    copy_rows(FIRST_BATCH, to_device=True)
    assert len(driver.copies) == FIRST_BATCH and not driver.batches


def test_copies_go_on_the_current_stream_of_their_gpu(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=8 + device.index))
    with RowCopies(torch.device("cuda", 1)) as copies:
        copies.copy(GPU, 0, ROW, HOST, 0, ROW, ROW, 2)
    assert [copy[-1] for copy in driver.copies] == [9]


def test_a_batch_on_the_current_gpu_names_that_gpu(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    with RowCopies(torch.device("cuda"), batched=True) as copies:
        copies.copy(GPU, 0, ROW, HOST, 0, ROW, ROW, 1)
    (batch,) = driver.batches
    assert (batch.dstLocHint.type, batch.dstLocHint.id) == (LOCATION_DEVICE, 3)


def test_a_full_batch_goes_out_at_once_and_each_next_batch_is_twice_as_large(driver: FakeDriver) -> None:
    with RowCopies(torch.device("cuda", 0), batched=True) as copies:
        for i in range(FIRST_BATCH + 2 * FIRST_BATCH + 1):
            copies.copy(GPU, i * ROW, ROW, HOST, i * ROW, ROW, ROW, 1)
            if i == FIRST_BATCH - 1:
                assert [call[3] for call in driver.calls] == [FIRST_BATCH], "a full batch waited for more copies"
    assert [call[3] for call in driver.calls] == [FIRST_BATCH, 2 * FIRST_BATCH, 1]


def test_a_2d_copy_the_driver_refused_raises_with_its_rows_and_code(driver: FakeDriver) -> None:
    driver.result = INVALID_VALUE
    with pytest.raises(RowCopyError, match=f"cuMemcpy2DAsync of 2 rows x {ROW} bytes failed with CUresult 1$"):
        RowCopies(torch.device("cuda", 0)).copy(GPU, 0, ROW, HOST, 0, ROW, ROW, 2)
