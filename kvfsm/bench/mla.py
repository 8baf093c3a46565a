"""Replicated (MLA) KV stored from TP=1 and TP=2 engines: store GB/s, bytes over PCIe and host pool bytes.

With MLA every rank holds the same KV. kvfsm stores it once per host (`OffloadConfig.replicated`): the ranks share
one host pool and each store is copied by its writer rank alone, so TP=2 moves the bytes TP=1 moves, each rank's
link carrying its share. Without `replicated` every rank stores into a pool of its own, as kvfsm did before: TP
times the bytes over PCIe and in host memory. Every rank holds the same DeepSeek-V3-shaped cache (a 576-wide bf16
latent per token and layer, filled with one byte pattern on the device) and stores the same blocks, as `jobs` store
orders of one step, timed from every rank's start to the last rank's last copy (median of `reps`). Every rank then
checks that its pool holds its cache's bytes.

One process: a worker half per GPU (CUDA), each rank's host submission on a thread of its own started together
(the copies are asynchronous, and the GIL is released while CUDA enqueues). The shared pool is one anonymous
mapping, as `kvfsm.Connector` makes for ranks in one process: registered once for both devices (portable), so its
pages are pinned once as across rank processes, and no `/dev/shm` room is needed (a container's default of 64 MiB
would refuse the default size). On a CPU the ranks are `SimDevice`s sent in turn: that checks the plumbing and the
byte counts in a second, not bandwidth. No process is spawned and no collective runs, so the run is bounded by its
copies (the default: 1.1 GiB a copy, seconds on two GPUs).

Threads: each rank's worker half is used by its own thread during a timed store and by the main thread otherwise
(registration, ordering the stores, reading the results). A thread's current CUDA device starts at 0, so each
sending thread makes its rank's device current first: torch's ops follow their tensors' devices, but the driver
calls of the copies (`kvfsm.executor.rows`) use the thread's current context.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
from rich.table import Table

from kvfsm.config import OffloadConfig, store_writer
from kvfsm.connector.metadata import ConnectorMetadata, StoreOrder
from kvfsm.connector.worker import WorkerConnector
from kvfsm.executor.cuda import CudaDevice
from kvfsm.executor.device import Device
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.shared_host import SharedHostMemory
from kvfsm.executor.sim import SimDevice

MODES = (("TP=1", 1, True), ("TP=2, one host copy", 2, True), ("TP=2, a pool per rank", 2, False))
"""(name, ranks, `replicated`)."""
RANKS = 2


class TwoDevicesNeeded(RuntimeError):
    """The bench's TP=2 modes need two CUDA devices (or none: SimDevices on the CPU)."""


class StoresFailed(RuntimeError):
    """A timed rep's store jobs failed: its GB/s would count bytes that never crossed PCIe."""


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


QUICK = MlaShape(layers=4, blocks=64, reps=2)
"""`--quick`: 18 MiB a copy."""
PLUMBING = MlaShape(layers=2, block_tokens=4, latent=16, blocks=16, jobs=4, reps=1)
"""On SimDevices: byte counts only."""


def devices(cuda: bool) -> list[Device]:
    """One device per rank of the TP=2 modes: two GPUs, or two SimDevices."""
    if not cuda:
        return [SimDevice() for _ in range(RANKS)]
    if torch.cuda.device_count() < RANKS:
        raise TwoDevicesNeeded(f"the MLA bench's TP={RANKS} modes need {RANKS} CUDA devices; "
                               f"this host has {torch.cuda.device_count()}")
    return [CudaDevice(index) for index in range(RANKS)]


def run(shape: MlaShape = MlaShape(), cuda: bool = True) -> dict[str, Any]:
    """Each mode of `MODES`: store GB/s (one copy's bytes over the wall time), bytes over PCIe and host pool bytes
    of all ranks together, and whether every rank's pool holds its cache's bytes."""
    ranks = devices(cuda)
    caches = [_filled_caches(shape, device) for device in ranks]
    rows = [{"mode": name, **_mode(shape, ranks[:count], caches[:count], replicated)}
            for name, count, replicated in MODES]
    return {"shape": asdict(shape), "rows": rows}


def _filled_caches(shape: MlaShape, device: Device) -> dict[str, torch.Tensor]:
    """MLA-shaped caches holding one byte pattern, made on the device (every rank the same bytes, as with MLA)."""
    caches, _ = allocate_kv_caches("mla", shape.layers, shape.blocks, shape.block_tokens, 1, shape.latent,
                                   torch.bfloat16, device.tensor_device())
    for layer, tensor in enumerate(caches.values()):
        raw = tensor.view(torch.uint8).view(-1)
        raw.copy_((torch.arange(raw.numel(), device=raw.device) * 131 + layer * 7) % 251)
    return caches


def _mode(shape: MlaShape, ranks: Sequence[Device], caches: Sequence[dict[str, torch.Tensor]],
          replicated: bool) -> dict[str, Any]:
    world = len(ranks)
    config = OffloadConfig(cpu_blocks=shape.blocks, gpu_block_size=shape.block_tokens, num_workers=world,
                           replicated=replicated)
    shared = SharedHostMemory(named=False) if replicated and world > 1 else None
    with ExitStack() as stack:
        workers = []
        for index, (device, cache) in enumerate(zip(ranks, caches)):
            worker = WorkerConnector(config, device, worker=index, shared_host=shared)
            stack.callback(worker.shutdown)
            worker.register_kv_caches(cache, "mla")
            workers.append(worker)
        host = shared.nbytes if shared is not None else sum(w.pool.registered_bytes for w in workers)
        per_job = shape.blocks // shape.jobs
        times, exact = [], True
        for rep in range(shape.reps):
            orders = tuple(StoreOrder(job_id=rep * shape.jobs + j, req_id=f"r{j}",
                                      gpu_blocks=tuple(range(j * per_job, (j + 1) * per_job)),
                                      cpu_slots=tuple(range(j * per_job, (j + 1) * per_job)))
                           for j in range(shape.jobs))
            for worker in workers:  # each rep from a cleared pool: a rep whose copies failed cannot pass on the
                worker.pool.buffer.zero_()  # bytes an earlier rep left
            times.append(_timed_store(workers, orders, step=2 * rep + 1))
            exact = exact and all(
                torch.equal(worker.pool.buffer[:shape.blocks * shape.block_bytes], _pool_image(cache))
                for worker, cache in zip(workers, caches))
        copied = sum(len(o.cpu_slots) for o in orders for index in range(world)
                     if not replicated or store_writer(o.job_id, world) == index) * shape.block_bytes
    seconds = statistics.median(times)
    stored = shape.blocks * shape.block_bytes
    return {"ranks": world, "stored_bytes": stored, "seconds": seconds, "store_gbps": stored / seconds / 1e9,
            "pcie_bytes": copied, "host_pool_bytes": host, "byte_exact": exact}


def _timed_store(workers: Sequence[WorkerConnector], orders: tuple[StoreOrder, ...], step: int) -> float:
    """Seconds from every rank's start to every rank's last copy of `orders`, ordered at `step` and sent the step
    after; on GPUs each rank sends from a thread of its own, all started at once."""
    for worker in workers:
        worker.bind_connector_metadata(ConnectorMetadata(step=step, stores=orders))
        worker.wait_for_save()
        worker.bind_connector_metadata(ConnectorMetadata(step=step + 1))
        _sync(worker.device)
    job_ids = [o.job_id for o in orders]
    sends = [_sender(worker, job_ids) for worker in workers]
    start = time.perf_counter()
    if isinstance(workers[0].device, SimDevice):  # a SimDevice runs its streams on the caller's thread
        for send in sends:
            send()
    else:
        _together(sends)
    seconds = time.perf_counter() - start
    failed = sorted({job for worker in workers for job in worker.get_finished().failed})
    if failed:
        raise StoresFailed(f"the MLA bench's store jobs {failed} failed: its figures would time copies not made")
    return seconds


def _sender(worker: WorkerConnector, job_ids: list[int]) -> Callable[[], None]:
    def send() -> None:
        if not isinstance(worker.device, SimDevice):
            _make_current(worker.device.tensor_device())
        worker.start_load_kv()
        worker.wait(job_ids)
        _sync(worker.device)

    return send


def _make_current(device: torch.device) -> None:
    """Make `device` (and its primary context) this thread's current one. `set_device` skips the runtime where
    the device already is current by number (device 0 in a new thread) without binding its context to the thread;
    a stream query is a runtime call on that device, which binds it."""
    torch.cuda.set_device(device)
    torch.cuda.current_stream(device).query()


def _together(sends: Sequence[Callable[[], None]]) -> None:
    """Run each rank's send on a thread of its own, released together; re-raise the first failure."""
    barrier = threading.Barrier(len(sends))
    errors: list[BaseException] = []

    def body(send: Callable[[], None]) -> None:
        try:
            barrier.wait()
            send()
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            errors.append(error)

    threads = [threading.Thread(target=body, args=(send,)) for send in sends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _pool_image(caches: dict[str, torch.Tensor]) -> torch.Tensor:
    """The host bytes a pool of these caches' blocks holds, block after block, each block's layers in order."""
    blocks = next(iter(caches.values())).shape[0]
    return torch.cat([t.view(torch.uint8).reshape(blocks, -1) for t in caches.values()], dim=1).reshape(-1).cpu()


def _sync(device: Device) -> None:
    if isinstance(device, SimDevice):
        device.run_until_idle()
    else:
        torch.cuda.synchronize(device.tensor_device())


def table(result: dict[str, Any]) -> Table:
    shape = result["shape"]
    out = Table(title=f"Replicated (MLA) KV stores: {shape['blocks']} blocks of {shape['layers']} layers x "
                      f"{shape['block_tokens']} tokens x {shape['latent']} bf16, one copy = "
                      f"{result['rows'][0]['stored_bytes'] / 2**30:.2f} GiB; GB/s of one copy's bytes")
    for column in ("mode", "store GB/s", "GB over PCIe", "bytes over PCIe / one copy", "host pool bytes / one copy",
                   "byte-exact"):
        out.add_column(column, justify="right")
    for row in result["rows"]:
        gbps = "—" if result.get("note") else f"{row['store_gbps']:.1f}"  # SimDevices measure no bandwidth
        stored = row["stored_bytes"]
        out.add_row(row["mode"], gbps, f"{row['pcie_bytes'] / 1e9:.2f}", f"{row['pcie_bytes'] / stored:.1f}",
                    f"{row['host_pool_bytes'] / stored:.1f}", "yes" if row["byte_exact"] else "NO")
    return out
