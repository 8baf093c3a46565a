"""What per-layer stores cost the sampled-token copy: the rule behind `layer_stores` being off by default.

vLLM PR 31341's discussion: store traffic must not delay the copy of the sampled token to the host, which is on the
critical path of every decode step. With `layer_stores`, each layer's stores start during the forward pass, so
when the forward ends the copy engines may still be moving the last layers' KV to the host; deferred stores (the
default) start only at the next step, after the token copy. This measures the token copy's latency (from the end
of the forward to the token on the host, GPU-timed) both ways, on a Llama-3-8B-shaped kv-first cache where one
step stores `stored_blocks` 16-token blocks (32 layers of 64 KiB each per block).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import ConnectorMetadata, StoreOrder
from kvfsm.connector.worker import WorkerConnector
from kvfsm.executor.cuda import CudaDevice
from kvfsm.executor.layouts import allocate_kv_caches

LAYER_CYCLES = 600_000
"""GPU cycles each layer's compute takes in the simulated forward (~0.3 ms on an H100)."""


def _trial(worker: WorkerConnector, names: list[str], stored_blocks: int, step: int) -> float:
    """Milliseconds from the end of one forward to its sampled token on the host."""
    order = StoreOrder(job_id=step, req_id=f"r{step}", gpu_blocks=tuple(range(stored_blocks)),
                       cpu_slots=tuple(range(stored_blocks)))
    worker.bind_connector_metadata(ConnectorMetadata(step=step, stores=(order,)))
    worker.handle_preemptions()
    worker.start_load_kv()
    token = torch.zeros((), dtype=torch.int64, device="cuda")
    host = torch.empty((), dtype=torch.int64).pin_memory()
    for name in names:
        torch.cuda._sleep(LAYER_CYCLES)
        worker.save_kv_layer(name)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host.copy_(token, non_blocking=True)
    end.record()
    worker.wait_for_save()
    worker.bind_connector_metadata(ConnectorMetadata(step=step + 1))  # deferred stores go out now
    worker.start_load_kv()
    end.synchronize()
    worker.wait(list(worker.jobs))
    torch.cuda.synchronize()
    worker.get_finished()
    return start.elapsed_time(end)


def run(stored_blocks: int = 512, trials: int = 15) -> dict[str, Any]:
    """Median and p90 token-copy milliseconds with per-layer and with deferred stores."""
    device = CudaDevice()
    tensors, _ = allocate_kv_caches("kv-first", 32, stored_blocks, 16, 8, 128, torch.bfloat16, "cuda")
    result: dict[str, Any] = {"stored_bytes": stored_blocks * (2 << 20)}
    for mode in ("deferred", "per-layer"):
        config = OffloadConfig(cpu_blocks=stored_blocks, gpu_block_size=16, layer_stores=mode == "per-layer")
        worker = WorkerConnector(config, device)
        worker.register_kv_caches(tensors, "kv-first")
        times = sorted([_trial(worker, list(tensors), stored_blocks, 2 * t + 1) for t in range(trials + 1)][1:])
        worker.shutdown()
        result[mode] = {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))]}
    return result
