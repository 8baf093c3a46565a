"""The connector's worker role: vLLM's model runner calls in, kvfsm's `WorkerConnector` executes the orders.

On a GPU the device is `CudaDevice`; on a CPU-only host it is `SimDevice`, whose streams run only when driven: vLLM's
forward pass has already run by the time completions are polled, so the simulated streams are run to idle then.
A failed load's GPU blocks are reported to vLLM (`get_block_ids_with_load_errors`) in the same step as the job, so
vLLM recomputes them instead of caching what the load never wrote. With `layer_loads` vLLM computes a CPU hit in the
step that loads it and reads that step's load errors only in that step's output, so the worker waits on the host
for the step's loads before it reports (`inline-load-in-step`): the compute stream waits on each layer's segment
anyway, so the wait ends no later than the layer that needs the last segment.
The lower tiers open here (the worker owns the CPU pool's bytes) and run the scheduler's tier orders; their job
reports travel with the transfer jobs', and what else the scheduler's index of each tier must hear is
`worker_tiers`'. Everything here runs on the worker's thread.
Under vLLM's hybrid allocator the layers of different KV-cache groups share tensors (layer i of each group pages
from tensor i): a block's bytes are that tensor's wherever its group is, so each tensor is registered once, under its
first layer's name, and the other layers name it through `_aliases`. A shared tensor is written by one layer of
each group in turn, so a per-layer store or load cannot be tied to one of them: with several groups those are
refused by name (`UnsupportedKVCache`), and whole-step transfers follow the forward pass.
With replicated (MLA) KV over several workers (`replicated`) the ranks share one host pool, a `/dev/shm` region:
rank 0 registers first, its pool creating the region, and sends the region's path to the other ranks over vLLM's
tensor-parallel CPU group (`region_path`); they attach to it and register. Every worker registers in the same call
of vLLM's start-up, so the broadcast meets. Should rank 0 fail to register, it sends no path and the others refuse
(`SharedRegionNotMade`) instead of waiting for one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvfsm.bindings import default_spec
from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import WorkerOutput
from kvfsm.connector.worker import WorkerConnector
from kvfsm.executor.cuda import CudaDevice
from kvfsm.executor.device import Device
from kvfsm.executor.layouts import KVCaches
from kvfsm.executor.shared_host import SharedHostMemory
from kvfsm.executor.sim import SimDevice
from kvfsm.integrations.vllm.config import UnsupportedKVCache, cache_layout, gpu_block_bytes
from kvfsm.integrations.vllm.convert import KvfsmMetadata, KvfsmWorkerMetadata
from kvfsm.integrations.vllm.worker_tiers import WorkerTiers
from kvfsm.machines import MachineSet

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def default_device() -> Device:
    return CudaDevice() if torch.cuda.is_available() else SimDevice()


def engine_rank(global_rank: int, world_size: int) -> int:
    """A worker's place among its engine's `world_size` workers (TP x PP x PCP, the count vLLM's
    `KVOutputAggregator` waits for): with data parallelism vLLM offsets each replica's ranks by
    `data_parallel_rank * world_size`."""
    return global_rank % world_size


def worker_rank(world_size: int) -> int:
    """This worker's id in job reports: its place in its engine, 0 when it is the only one."""
    return engine_rank(torch.distributed.get_rank(), world_size) if torch.distributed.is_initialized() else 0


class SharedRegionNotMade(RuntimeError):
    """Replicated KV: rank 0 could not make the host region the ranks share (its own error says why)."""


def region_path(path: str | None) -> str | None:
    """Rank 0's shared-region path, for every rank of the engine: rank 0 passes its path (None where it failed), the
    others None. A broadcast on vLLM's tensor-parallel group (gloo), which is the engine's world with replicated KV."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().broadcast_object(path, src=0)


class WorkerSide:
    def __init__(self, config: OffloadConfig, kv_cache_config: "KVCacheConfig", device: Device,
                 rank: int) -> None:
        self.config = config
        self.device = device
        machines = MachineSet(default_spec())
        self._tiers = WorkerTiers(machines, [t.tier_name for t in config.lower_tiers
                                             if t.kind == "mooncake" or t.shared])  # type: ignore[union-attr]
        self._shared = SharedHostMemory() if config.replicated and config.num_workers > 1 else None
        """With replicated KV over several workers: the host region the ranks share (rank 0 makes it)."""
        self.kvfsm = WorkerConnector(config, device, worker=rank, machines=machines, shared_host=self._shared)
        self._rank = rank
        self._num_blocks = kv_cache_config.num_blocks
        self._scheduler_block_bytes = gpu_block_bytes(kv_cache_config)
        if len(kv_cache_config.kv_cache_groups) > 1 and (config.layer_loads or config.layer_stores):
            raise UnsupportedKVCache("layer_loads and layer_stores need one KV-cache group: under vLLM's hybrid "
                                     "allocator each tensor is written by a layer of every group in turn")
        self._aliases: dict[str, str] = {}
        """Each layer's name to the name its tensor is registered under (itself, unless another group's layer
        registered the same tensor first)."""
        self._loads: dict[int, tuple[int, ...]] = {}
        self._step_loads: tuple[int, ...] = ()
        self._reports: list[WorkerOutput] = []
        self._invalid: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first: dict[tuple[int, tuple[int, ...]], str] = {}
        self._aliases = {name: first.setdefault((t.data_ptr(), tuple(t.shape)), name) for name, t in kv_caches.items()}
        kv_caches = {name: t for name, t in kv_caches.items() if self._aliases[name] == name}
        layout = cache_layout(kv_caches, self._num_blocks)
        caches = (self.kvfsm.register_kv_caches(kv_caches, layout) if self._shared is None
                  else self._register_shared(kv_caches, layout))
        ours, theirs = (self.config.num_cpu_blocks(b) for b in (caches.gpu_block_bytes, self._scheduler_block_bytes))
        if ours != theirs:
            raise UnsupportedKVCache(
                f"this worker's caches hold {caches.gpu_block_bytes} bytes per block, the scheduler sized the pool for "
                f"{self._scheduler_block_bytes}: the pools would differ ({ours} vs {theirs} CPU blocks)")
        self._tiers.opened(self.kvfsm.lower_tiers, self._rank)

    def _register_shared(self, kv_caches: dict[str, torch.Tensor], layout: str) -> KVCaches:
        """Replicated KV: rank 0's pool makes the region, whose path the others then attach to."""
        assert self._shared is not None
        if self._rank == 0:
            try:
                caches = self.kvfsm.register_kv_caches(kv_caches, layout)
            except BaseException:
                region_path(None)  # the other ranks stop waiting, and refuse
                raise
            region_path(self._shared.path)
            return caches
        path = region_path(None)
        if path is None:
            raise SharedRegionNotMade(f"worker {self._rank}: rank 0 could not make the host region the ranks share "
                                      "(replicated KV); its error says why")
        self._shared.attach(path)
        return self.kvfsm.register_kv_caches(kv_caches, layout)

    def bind(self, meta: object) -> None:
        if not isinstance(meta, KvfsmMetadata):
            raise TypeError(f"expected kvfsm connector metadata, got {type(meta).__name__}")
        self.kvfsm.bind_connector_metadata(meta.orders)
        self._tiers.apply(meta)
        self._loads.update((order.job_id, order.gpu_blocks) for order in meta.orders.loads)
        self._step_loads = tuple(order.job_id for order in meta.orders.loads)

    def handle_preemptions(self, meta: object) -> None:
        self.bind(meta)
        self.kvfsm.handle_preemptions()

    def start_load_kv(self) -> None:
        self.kvfsm.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.kvfsm.wait_for_layer_load(self._aliases.get(layer_name, layer_name))

    def save_kv_layer(self, layer_name: str) -> None:
        self.kvfsm.save_kv_layer(self._aliases.get(layer_name, layer_name))

    def wait_for_save(self) -> None:
        self.kvfsm.wait_for_save()

    def poll(self) -> None:
        """Collect the jobs that finished since the last poll (once per step, before the two reports below)."""
        if isinstance(self.device, SimDevice):
            self.device.run_until_idle()
        elif self.config.inline_loads:  # computed on this step: reported in this step's output
            self.kvfsm.wait(self._step_loads)
        report = self.kvfsm.get_finished()
        for job_id in report.failed:
            self._invalid.update(self._loads.pop(job_id, ()))
        for job_id in report.done:
            self._loads.pop(job_id, None)
        if report.done or report.failed or report.tiers:
            self._reports.append(report)

    def take_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def take_worker_meta(self) -> KvfsmWorkerMetadata | None:
        reports, self._reports = tuple(self._reports), []
        evicted, namespaces = self._tiers.take()
        return KvfsmWorkerMetadata(reports, evicted, namespaces) if reports or evicted or namespaces else None

    def shutdown(self) -> None:
        self.kvfsm.shutdown()
