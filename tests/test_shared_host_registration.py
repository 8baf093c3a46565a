"""Replicated (MLA) KV with every rank in one process: the ranks' one host pool is one mapping, registered once
for every device of the process and released once (CUDA refuses a second registration of a range still registered:
cudaErrorHostMemoryAlreadyRegistered). SimDevices keep the process's table of registered ranges as the driver does,
so on the CPU a second registration fails as it would on two GPUs (`test_gpu_two_devices.py` runs the same on two
CUDA devices, each copying through the shared pool)."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from kvfsm.config import OffloadConfig
from kvfsm.connector import Connector
from kvfsm.connector.worker import WorkerConnector
from kvfsm.executor.device import Device, HostMemoryAlreadyRegistered
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.shared_host import SharedHostMemory
from kvfsm.executor.sim import SimDevice

LAYERS, BLOCKS, BLOCK_TOKENS, LATENT, CPU_BLOCKS = 2, 4, 4, 16, 4
ONE_COPY = CPU_BLOCKS * LAYERS * BLOCK_TOKENS * LATENT * 2  # bf16


def config() -> OffloadConfig:
    return OffloadConfig(cpu_blocks=CPU_BLOCKS, gpu_block_size=BLOCK_TOKENS, num_workers=2, replicated=True)


def mla_caches(device: Device, fill: int) -> dict[str, torch.Tensor]:
    caches, _ = allocate_kv_caches("mla", LAYERS, BLOCKS, BLOCK_TOKENS, 1, LATENT, torch.bfloat16,
                                   device.tensor_device())
    for layer, tensor in enumerate(caches.values()):
        raw = tensor.view(torch.uint8).view(-1)
        raw.copy_((torch.arange(raw.numel(), device=raw.device) * fill + layer) % 251)
    return caches


def registered_ranks(devices: Sequence[Device]) -> tuple[Connector, list[dict[str, torch.Tensor]]]:
    connector = Connector(config(), devices)
    caches = [mla_caches(device, fill) for device, fill in zip(devices, (131, 0))]
    for rank, cache in enumerate(caches):
        connector.register_kv_caches(cache, "mla", rank=rank)
    return connector, caches


def test_two_ranks_in_one_process_register_their_shared_pool_once_and_release_it_once() -> None:
    devices = [SimDevice(), SimDevice()]
    connector, _ = registered_ranks(devices)
    buffer = connector.workers[0].pool.buffer
    assert connector.workers[1].pool.buffer.data_ptr() == buffer.data_ptr(), "the ranks' pools are not one mapping"
    assert [device.registered_bytes for device in devices] == [ONE_COPY, 0]
    connector.workers[0].shutdown()
    assert devices[0].registered_bytes == ONE_COPY, "released while rank 1's pool still uses it"
    connector.workers[1].shutdown()
    assert [device.registered_bytes for device in devices] == [0, 0]
    again = SimDevice()  # released from the process's table too: registering the range again is no clash
    again.register_host(buffer)
    again.unregister_host(buffer)


class EveryRankRegisters(SharedHostMemory):
    """Control: each rank registers the one mapping itself, as kvfsm did before."""

    def allocate(self, device: Device, nbytes: int) -> torch.Tensor:
        buffer = self._anonymous(nbytes)
        device.register_host(buffer)
        return buffer


def test_control_each_rank_registering_the_shared_mapping_is_refused_as_cuda_refuses_it() -> None:
    shared = EveryRankRegisters(named=False)
    devices = [SimDevice(), SimDevice()]
    workers = [WorkerConnector(config(), device, worker=rank, shared_host=shared)
               for rank, device in enumerate(devices)]
    workers[0].register_kv_caches(mla_caches(devices[0], 131), "mla")
    try:
        with pytest.raises(HostMemoryAlreadyRegistered, match="registered in this process and not released"):
            workers[1].register_kv_caches(mla_caches(devices[1], 0), "mla")
    finally:
        devices[0].unregister_host(workers[0].pool.buffer)
