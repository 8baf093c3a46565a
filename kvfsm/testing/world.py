"""The `World` the spec's invariants read, assembled from a running engine, its connector and its device."""

from __future__ import annotations

from typing import Mapping, Sequence

from kvfsm.connector import Connector
from kvfsm.engine.engine import Engine
from kvfsm.executor.access import Access
from kvfsm.invariants import Deferral
from kvfsm.records import CpuBlock, GpuBlock, RequestRecord, TransferJob
from kvfsm.tiers.base import LowerTier
from kvfsm.records import TierJob


class EngineWorld:
    """A live view: every attribute reads the current state, so one instance serves a whole run."""

    def __init__(self, engine: Engine, connector: Connector) -> None:
        self.engine = engine
        self.connector = connector

    @property
    def cpu_blocks(self) -> Sequence[CpuBlock]:
        return self.connector.scheduler.manager.blocks

    @property
    def catalogue(self) -> Mapping[int, int]:
        return self.connector.scheduler.manager.catalogue

    @property
    def jobs(self) -> Mapping[int, TransferJob]:
        return self.connector.scheduler.jobs

    @property
    def requests(self) -> Mapping[str, RequestRecord]:
        return self.connector.scheduler.requests

    @property
    def gpu_blocks(self) -> Mapping[int, GpuBlock]:
        return self.connector.scheduler.gpu_blocks

    @property
    def deferrals(self) -> Mapping[str, Deferral]:
        return self.connector.scheduler.deferrals

    @property
    def reported_failed(self) -> set[int]:
        tiers = self.connector.scheduler.tiers
        failed = self.connector.scheduler.reported_failed
        return failed | tiers.reported_failed if tiers is not None else failed

    @property
    def tiers(self) -> Sequence[LowerTier]:
        return self.connector.worker.lower_tiers

    @property
    def tier_jobs(self) -> Mapping[int, TierJob]:
        tiers = self.connector.scheduler.tiers
        return tiers.jobs if tiers is not None else {}

    @property
    def writeback_bound(self) -> int:
        return self.connector.config.writeback_max_bytes_in_flight

    @property
    def accesses(self) -> Sequence[Access]:
        return getattr(self.engine.device, "accesses", ())

    @property
    def num_workers(self) -> int:
        return self.connector.config.num_workers

    @property
    def idle(self) -> bool:
        tiers = self.connector.scheduler.tiers
        return (not self.engine.has_work and getattr(self.engine.device, "idle", True)
                and (tiers is None or tiers.idle))
