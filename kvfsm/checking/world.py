"""kvfsm's `World` (what the named invariants read) seen from a scheduler half, and from a device log alone.

`ConnectorWorld` is the part of the world every integration has: the scheduler half's records. An engine adds its
device log and knows when it is idle (`kvfsm.checking.integration.IntegrationWorld`); an adapter whose worker lives
in another process has neither, and says itself when everything should be drained (`idle`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.executor.access import Access
from kvfsm.executor.device import Device
from kvfsm.invariants import Deferral, RoomLookup, TierView
from kvfsm.records import CpuBlock, GpuBlock, RequestRecord, TransferJob
from kvfsm.tier_records import TierJob


def _never() -> bool:
    return False


class ConnectorWorld:
    """A live view of a scheduler half: every attribute reads the current state, so one instance serves a whole
    run. No device log and no lower tier is visible from here (`accesses` and `tiers` are empty); `is_idle` says
    when the engine and the workers have nothing left, which turns on the `drained` invariant."""

    def __init__(self, scheduler: SchedulerConnector, is_idle: Callable[[], bool] = _never) -> None:
        self.scheduler = scheduler
        self._is_idle = is_idle

    @property
    def idle(self) -> bool:
        return self._is_idle()

    @property
    def accesses(self) -> Sequence[Access]:
        return ()

    @property
    def tiers(self) -> Sequence[TierView]:
        return ()

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
    def tier_jobs(self) -> Mapping[int, TierJob]:
        return self.scheduler.tier_jobs

    @property
    def writeback_bound(self) -> int:
        return self.scheduler.config.writeback_max_bytes_in_flight

    @property
    def store_bound(self) -> int | None:
        return self.scheduler.config.store_max_blocks_in_flight

    @property
    def writeback_queues(self) -> Mapping[str, tuple[int, int | None]]:
        tiers = self.scheduler.tiers
        return tiers.queues() if tiers is not None else {}

    @property
    def eager_tiers(self) -> frozenset[str]:
        return frozenset(t.tier_name for t in self.scheduler.config.lower_tiers if t.writeback == "eager")

    @property
    def room_lookups(self) -> Sequence[RoomLookup]:
        tiers = self.scheduler.tiers
        return tiers.room_lookups if tiers is not None else ()

    @property
    def num_workers(self) -> int:
        return self.scheduler.config.num_workers

    @property
    def rank(self) -> int:
        return 0

    @property
    def replicated(self) -> bool:
        return self.scheduler.config.replicated

    @property
    def async_scheduling(self) -> bool:
        return self.scheduler.config.async_scheduling


DEVICE_LOG_INVARIANTS = ("store-after-compute", "layer-store-after-compute", "fence", "layer-stores-flushed",
                         "load-after-readers", "load-before-use", "layer-load-before-use", "readers-pin",
                         "ready-means-written", "replicated-single-writer")
"""The invariants that read a device's access log: with tensor parallelism they hold on every rank's device."""


@dataclass
class DeviceLogWorld:
    """A device's access log and no scheduler state: what a rank whose process holds no scheduler half checks
    (`DEVICE_LOG_INVARIANTS`; their state checks find nothing here, the scheduler's process checks the state)."""

    device: Device
    cpu_blocks: Sequence[CpuBlock] = ()
    catalogue: Mapping[int, int] = field(default_factory=dict)
    idle: bool = False
    rank: int = 0
    num_workers: int = 1
    replicated: bool = False

    @property
    def accesses(self) -> Sequence[Access]:
        return getattr(self.device, "accesses", ())
