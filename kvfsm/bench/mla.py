"""Replicated (MLA) KV stored from TP=1 and TP=2 engines: store GB/s, bytes over PCIe and host pool bytes.

With MLA every rank holds the same KV. kvfsm stores it once per host (`OffloadConfig.replicated`): the ranks share
one host pool and each store is copied by its writer rank alone, so TP=2 moves the bytes TP=1 moves, each rank's
link carrying its share. Without `replicated` every rank stores into a pool of its own, as kvfsm did before: TP
times the bytes over PCIe and in host memory. One process per rank (NCCL and one GPU each on CUDA; gloo and `SimDevice`s on a CPU,
which checks the plumbing and the byte counts, not bandwidth); every rank holds the same DeepSeek-V3-shaped cache
(a 576-wide bf16 latent per token and layer) and stores the same blocks, as `jobs` store orders of one step, timed
from a barrier to the last rank's last copy (median of `reps`). Every rank then checks that its pool's slots hold
its cache's bytes.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rich.table import Table

from kvfsm.config import OffloadConfig, store_writer
from kvfsm.connector.metadata import ConnectorMetadata, StoreOrder
from kvfsm.connector.worker import WorkerConnector
from kvfsm.engine.distributed import host_pool_bytes, register_in_turn
from kvfsm.executor.cuda import CudaDevice
from kvfsm.executor.device import Device
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.sim import SimDevice

MODES = (("TP=1", 1, True), ("TP=2, one host copy", 2, True), ("TP=2, a pool per rank", 2, False))
"""(name, ranks, `replicated`)."""


@dataclass(frozen=True)
class MlaShape:
    """A DeepSeek-V3-shaped replicated cache (61 layers, a 576-wide latent of bf16 per token) and the run's size."""

    layers: int = 61
    block_tokens: int = 64
    latent: int = 576
    blocks: int = 256
    jobs: int = 16
    reps: int = 5

    @property
    def block_bytes(self) -> int:
        return self.layers * self.block_tokens * self.latent * 2  # bf16


def _rank(index: int, world: int, rendezvous: str, shape: MlaShape, cuda: bool, replicated: bool, out: str) -> None:
    dist.init_process_group("nccl" if cuda else "gloo", init_method=rendezvous, rank=index, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        result = _store(index, world, shape, cuda, replicated)
        if index == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _store(index: int, world: int, shape: MlaShape, cuda: bool, replicated: bool) -> dict[str, Any]:
    device: Device
    if cuda:
        torch.cuda.set_device(index)
        device = CudaDevice(index)
    else:
        device = SimDevice()
    torch.manual_seed(0)  # every rank holds the same KV
    caches, _ = allocate_kv_caches("mla", shape.layers, shape.blocks, shape.block_tokens, 1, shape.latent,
                                   torch.bfloat16, device.tensor_device())
    for tensor in caches.values():
        tensor.copy_(torch.randn(tensor.shape, dtype=torch.bfloat16))
    config = OffloadConfig(cpu_blocks=shape.blocks, gpu_block_size=shape.block_tokens, num_workers=world,
                           replicated=replicated)
    group = dist.new_group(backend="gloo")

    def register(shared: Any) -> WorkerConnector:
        worker = WorkerConnector(config, device, worker=index, shared_host=shared)
        worker.register_kv_caches(caches, "mla")
        return worker

    worker, shared = register_in_turn(group, replicated and world > 1, register)
    host = host_pool_bytes(device, shared, group)
    per_job = shape.blocks // shape.jobs
    times = []
    for rep in range(shape.reps):
        orders = tuple(StoreOrder(job_id=rep * shape.jobs + j, req_id=f"r{j}",
                                  gpu_blocks=tuple(range(j * per_job, (j + 1) * per_job)),
                                  cpu_slots=tuple(range(j * per_job, (j + 1) * per_job))) for j in range(shape.jobs))
        copied = sum(len(o.cpu_slots) for o in orders
                     if not replicated or store_writer(o.job_id, world) == index) * shape.block_bytes
        times.append(_timed_store(worker, device, group, orders, step=2 * rep + 1))
    seconds = statistics.median(times)
    exact = all(torch.equal(worker.pool.slot(b).cpu(), _block_bytes(caches, b).cpu()) for b in range(shape.blocks))
    totals = [None] * world
    dist.all_gather_object(totals, (copied, exact), group=group)
    worker.shutdown()
    stored = shape.blocks * shape.block_bytes
    return {"ranks": world, "stored_bytes": stored, "seconds": seconds, "store_gbps": stored / seconds / 1e9,
            "pcie_bytes": sum(c for c, _ in totals), "host_pool_bytes": host,
            "byte_exact": all(e for _, e in totals)}


def _timed_store(worker: WorkerConnector, device: Device, group: dist.ProcessGroup, orders: tuple[StoreOrder, ...],
                 step: int) -> float:
    """Seconds from a barrier to every rank's last copy of `orders`, ordered at `step` and sent the step after."""
    worker.bind_connector_metadata(ConnectorMetadata(step=step, stores=orders))
    worker.wait_for_save()
    worker.bind_connector_metadata(ConnectorMetadata(step=step + 1))
    _sync(device)
    dist.barrier(group)
    start = time.perf_counter()
    worker.start_load_kv()
    worker.wait([o.job_id for o in orders])
    _sync(device)
    dist.barrier(group)
    seconds = time.perf_counter() - start
    worker.get_finished()
    return seconds


def _block_bytes(caches: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([tensor[block].contiguous().view(torch.uint8).flatten() for tensor in caches.values()])


def _sync(device: Device) -> None:
    if isinstance(device, SimDevice):
        device.run_until_idle()
    else:
        torch.cuda.synchronize()


def run(shape: MlaShape = MlaShape(), cuda: bool = True) -> dict[str, Any]:
    """Each mode of `MODES` in processes of its own: store GB/s (one copy's bytes over the wall time), bytes over
    PCIe and host pool bytes of all ranks together, and whether every rank's slots hold its bytes."""
    rows = []
    for name, ranks, replicated in MODES:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "result"
            mp.start_processes(_rank, nprocs=ranks, start_method="spawn", join=True,
                               args=(ranks, f"file://{folder}/rendezvous", shape, cuda, replicated, str(out)))
            rows.append({"mode": name, **json.loads(out.read_text())})
    return {"shape": asdict(shape), "rows": rows}


def table(result: dict[str, Any]) -> Table:
    shape = result["shape"]
    out = Table(title=f"Replicated (MLA) KV stores: {shape['blocks']} blocks of {shape['layers']} layers x "
                      f"{shape['block_tokens']} tokens x {shape['latent']} bf16, one copy = "
                      f"{result['rows'][0]['stored_bytes'] / 2**30:.2f} GiB; GB/s of one copy's bytes")
    for column in ("mode", "store GB/s", "bytes over PCIe / one copy", "host pool bytes / one copy", "byte-exact"):
        out.add_column(column, justify="right")
    for row in result["rows"]:
        out.add_row(row["mode"], f"{row['store_gbps']:.1f}", f"{row['pcie_bytes'] / row['stored_bytes']:.1f}",
                    f"{row['host_pool_bytes'] / row['stored_bytes']:.1f}", "yes" if row["byte_exact"] else "NO")
    return out
