"""`kvfsm.Connector`: the scheduler half and the worker halves of the connector, for an engine in one process.

One worker half per device (a tensor-parallel rank; its worker id is its rank). Multi-process engines use
`SchedulerConnector` in the scheduler process and one `WorkerConnector` per GPU worker; the metadata between them is
pydantic (`kvfsm.connector.metadata`).
"""

from __future__ import annotations

import torch

from typing import Sequence

from kvfsm.bindings import default_spec
from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import ConnectorMetadata, ConnectorOutput, SchedulerOutput
from kvfsm.connector.refusals import NotRegistered, UnknownWorker
from kvfsm.connector.request_view import RequestView
from kvfsm.connector.scheduler import SchedulerConnector, StepResult
from kvfsm.connector.validation import check_halves
from kvfsm.connector.worker import WorkerConnector
from kvfsm.executor.device import Device
from kvfsm.executor.layouts import KVCaches
from kvfsm.executor.shared_host import SharedHostMemory
from kvfsm.machines import MachineSet
from kvfsm.manager.events import KVCacheEvent
from kvfsm.tiers.factory import IoFactory

__all__ = ["Connector", "SchedulerConnector", "WorkerConnector", "StepResult"]


class WorkerCountMismatch(ValueError):
    """A connector was given a different number of devices than `num_workers` ranks, or tensor-parallel ranks
    together with a lower tier (each tier is one worker's), unless the KV is replicated: one rank then opens and
    moves every tier, the one whose tiers the scheduler half looks up in."""


class RankBlockSizeMismatch(ValueError):
    """Two ranks registered KV caches of different sizes: their pools would not line up slot for slot."""


class Connector:
    """Both halves in one object; the scheduler half exists once the KV caches are registered (it needs their size).

    `device` is one device, or one per tensor-parallel rank (`config.num_workers` of them), each rank registering
    its own caches: its share of the heads."""

    def __init__(self, config: OffloadConfig, device: Device | Sequence[Device], keep_history: bool = False,
                 machines: MachineSet | None = None, tier_io: IoFactory | None = None) -> None:
        devices = list(device) if isinstance(device, Sequence) else [device]
        for each in devices:
            check_halves("Connector", config, each)
        if len(devices) != config.num_workers or (len(devices) > 1 and config.lower_tiers and not config.replicated):
            raise WorkerCountMismatch(f"Connector: {len(devices)} devices with num_workers={config.num_workers} "
                                      f"and {len(config.lower_tiers)} lower tiers; legal: one device per worker, "
                                      "lower tiers with one worker only or with replicated KV")
        self.config = config
        self.machines = machines or MachineSet(default_spec())
        """This connector's machines, shared by both halves: observe them to trace this connector alone."""
        self.shared_host = SharedHostMemory(named=False) if config.replicated and len(devices) > 1 else None
        """With replicated KV over several ranks: the one host pool they share (its region removed once the last
        rank's pool is closed)."""
        self.workers = [WorkerConnector(config, each, worker=rank, machines=self.machines, tier_io=tier_io,
                                        keep_lookups=keep_history, shared_host=self.shared_host,
                                        keep_store_bytes=keep_history)
                        for rank, each in enumerate(devices)]
        self.keep_history = keep_history
        self._scheduler: SchedulerConnector | None = None

    @property
    def worker(self) -> WorkerConnector:
        """Rank 0's worker half (the only one without tensor parallelism)."""
        return self.workers[0]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layout: str,
                           groups: dict[str, list[str]] | None = None, rank: int = 0) -> KVCaches:
        """Register one rank's caches; every rank's must have as many bytes per block (its share of the heads)."""
        if not 0 <= rank < len(self.workers):
            raise UnknownWorker(f"register_kv_caches: rank {rank}; legal ranks with {len(self.workers)} devices: "
                                f"0 to {len(self.workers) - 1}")
        caches = self.workers[rank].register_kv_caches(kv_caches, layout, groups)
        if self._scheduler is None:
            self._scheduler = SchedulerConnector(self.config, caches.gpu_block_bytes, self.machines,
                                                 keep_history=self.keep_history, num_gpu_blocks=caches.num_blocks,
                                                 tiers=self.worker.lower_tiers)
        elif caches.gpu_block_bytes != self._scheduler.gpu_block_bytes:
            raise RankBlockSizeMismatch(f"rank {rank} registered {caches.gpu_block_bytes} bytes per GPU block, "
                                        f"rank 0 {self._scheduler.gpu_block_bytes}")
        return caches

    @property
    def scheduler(self) -> SchedulerConnector:
        if self._scheduler is None:
            raise NotRegistered("register_kv_caches must run before the scheduler half is used")
        return self._scheduler

    @property
    def moving_between_tiers(self) -> bool:
        """A write-back or fetch is in flight: the engine keeps stepping (idle steps) until it is reported."""
        return self._scheduler is not None and self._scheduler.moving_between_tiers

    @property
    def stores_of_ended_requests(self) -> bool:
        """An ended request's stores are in flight: an engine with nothing else to do steps until they end."""
        return self._scheduler is not None and self._scheduler.stores_of_ended_requests

    def tracks(self, request_id: str) -> bool:
        """Whether the request is still known (a returned one until its last store ends): its id may not return."""
        return self._scheduler is not None and self._scheduler.tracks(request_id)

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool] | None:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, output: SchedulerOutput) -> ConnectorMetadata:
        return self.scheduler.build_connector_meta(output)

    def update_connector_output(self, output: ConnectorOutput) -> StepResult:
        return self.scheduler.update_connector_output(output)

    def request_finished(self, request_id: str, aborted: bool = False) -> bool:
        return self.scheduler.request_finished(request_id, aborted)

    def reset_cache(self) -> None:
        self.scheduler.reset_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, oldest first: which prefixes became loadable from the host
        pool (`BlockStored`) or stopped being so (`BlockRemoved`). Empty unless `config.kv_events` is on."""
        return self.scheduler.manager.take_events()
