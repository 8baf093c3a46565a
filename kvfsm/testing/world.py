"""The `World` the spec's invariants read, assembled from a running engine, its connector and its device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from kvfsm.connector import Connector, SchedulerConnector
from kvfsm.engine.engine import Engine
from kvfsm.executor.access import Access
from kvfsm.executor.device import Device
from kvfsm.invariants import Deferral
from kvfsm.records import CpuBlock, GpuBlock, RequestRecord, TransferJob
from kvfsm.tiers.base import LowerTier
from kvfsm.records import TierJob


class EngineWorld:
    """A live view: every attribute reads the current state, so one instance serves a whole run.

    The device log is rank 0's unless `device` names another rank's (the ordering invariants hold on each rank's
    device). `connector` is both halves, or the scheduler half alone (the other ranks' halves in other processes).
    """

    def __init__(self, engine: Engine, connector: Connector | SchedulerConnector, device: Device | None = None) -> None:
        self.engine = engine
        self.connector = connector
        self.scheduler = connector.scheduler if isinstance(connector, Connector) else connector
        self.device = device or engine.device

    @property
    def cpu_blocks(self) -> Sequence[CpuBlock]:
        return self.scheduler.manager.blocks

    @property
    def catalogue(self) -> Mapping[int, int]:
        return self.scheduler.manager.catalogue

    @property
    def jobs(self) -> Mapping[int, TransferJob]:
        return self.scheduler.jobs

    @property
    def requests(self) -> Mapping[str, RequestRecord]:
        return self.scheduler.requests

    @property
    def gpu_blocks(self) -> Mapping[int, GpuBlock]:
        return self.scheduler.gpu_blocks

    @property
    def deferrals(self) -> Mapping[str, Deferral]:
        return self.scheduler.deferrals

    @property
    def reported_failed(self) -> set[int]:
        return self.scheduler.reported_failed

    @property
    def tiers(self) -> Sequence[LowerTier]:
        return self.connector.worker.lower_tiers if isinstance(self.connector, Connector) else ()

    @property
    def tier_jobs(self) -> Mapping[int, TierJob]:
        return self.scheduler.tier_jobs

    @property
    def writeback_bound(self) -> int:
        return self.connector.config.writeback_max_bytes_in_flight

    @property
    def accesses(self) -> Sequence[Access]:
        return getattr(self.device, "accesses", ())

    @property
    def num_workers(self) -> int:
        return self.connector.config.num_workers

    @property
    def idle(self) -> bool:
        tiers = self.scheduler.tiers
        devices = [rank.device for rank in self.engine.ranks.local] if self.engine.ranks else [self.engine.device]
        return (not self.engine.has_work and all(getattr(device, "idle", True) for device in devices)
                and (tiers is None or tiers.idle))


DEVICE_LOG_INVARIANTS = ("store-after-compute", "layer-store-after-compute", "fence", "layer-stores-flushed",
                         "load-after-readers", "load-before-use", "layer-load-before-use", "readers-pin",
                         "ready-means-written")
"""The invariants that read a device's access log: with tensor parallelism they hold on every rank's device."""


@dataclass
class DeviceLogWorld:
    """A device's access log and no scheduler state: what a rank whose process holds no scheduler half checks
    (`DEVICE_LOG_INVARIANTS`; their state checks find nothing here, the scheduler's process checks the state)."""

    device: Device
    cpu_blocks: Sequence[CpuBlock] = ()
    catalogue: Mapping[int, int] = field(default_factory=dict)
    idle: bool = False

    @property
    def accesses(self) -> Sequence[Access]:
        return getattr(self.device, "accesses", ())
