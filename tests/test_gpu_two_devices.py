"""Two CUDA devices in one process (tensor-parallel ranks on threads, as `python -m kvfsm.bench mla` runs them): the
ranks' shared host pool registered once and reached by each device's copies, and block ids uploaded right on the
second device whichever device's context pinned their host memory. Skipped unless two CUDA devices are present."""

from __future__ import annotations

import pytest
import torch

from kvfsm.executor.block_ids import BlockIds
from kvfsm.executor.cuda import CudaDevice
from test_shared_host_registration import registered_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_two_cuda_devices_in_one_process_register_the_shared_pool_once_and_each_copies_through_it() -> None:
    """Rank 0 stores into the pool that rank 1 then loads from: each device's copies reach the one registration
    (portable), made by rank 0's device, from the main thread whose current device is 0 throughout."""
    devices = [CudaDevice(0), CudaDevice(1)]
    connector, caches = registered_ranks(devices)
    try:
        for index in (0, 1):
            torch.cuda.synchronize(index)  # the fills ran on each device's current stream
        connector.workers[0].transfers.store([0, 1], [2, 3])
        torch.cuda.synchronize(0)
        connector.workers[1].transfers.load([2, 3], [1, 2])
        torch.cuda.synchronize(1)
        for written, loaded in zip(caches[0].values(), caches[1].values()):
            assert torch.equal(loaded[1:3].cpu().view(torch.uint8), written[0:2].cpu().view(torch.uint8)), \
                "rank 1 did not load what rank 0 stored"  # bytes: the fill's bf16 patterns include NaNs
    finally:
        for worker in connector.workers:
            worker.shutdown()


def test_block_ids_reach_the_second_device_though_device_zero_pinned_their_host_memory() -> None:
    """torch's pinned allocator hands a block freed under device 0's context to device 1's next request of that
    size; a kernel on device 1 cannot read it as a device-0 tensor, and the ids must arrive all the same."""
    ids = list(range(37, 0, -3))
    for _ in range(8):
        with torch.cuda.device(0):
            torch.empty(len(ids), dtype=torch.int64, pin_memory=True)  # freed at once, kept by the allocator
        with torch.cuda.device(1), torch.cuda.stream(torch.cuda.Stream(1)):
            uploaded = BlockIds(torch.device("cuda", 1))(ids)
            torch.cuda.current_stream(1).synchronize()
        assert uploaded.device == torch.device("cuda", 1) and uploaded.tolist() == ids
