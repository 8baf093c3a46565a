"""Checking your own engine's integration: kvfsm's invariants over the connector and the engine's block tables.

An engine exposes its own bookkeeping through the small `EngineTables` protocol (which GPU blocks each request
holds, which ones its allocator may hand out); `IntegrationWorld` joins that to the connector's records and, on
`SimDevice`, the log of every access the device ran. `IntegrationCheck` runs every named invariant and the trace
after each step, plus `fence` read from the engine's tables: a store kvfsm has not flushed reads its GPU blocks
until it is done, so none of them may be free in the engine or held by anyone but the store's request (unless the
request ended and gave them back, or its sliding window left them behind: those are fenced when handed out again,
`lazy-fence`, `window-fence`). That
reading needs no device log, so it catches a block reused under a store in flight on a GPU too, and at the step
the engine frees it rather than when a write happens to run first.
"""

from __future__ import annotations

from typing import Collection, Mapping, Protocol, Sequence, runtime_checkable

from kvfsm.checking.checks import RunChecks
from kvfsm.checking.world import ConnectorWorld
from kvfsm.connector import Connector, SchedulerConnector
from kvfsm.executor.access import Access
from kvfsm.executor.device import Device
from kvfsm.invariants import TierView
from kvfsm.records import FLUSHABLE_JOB_STATES
from kvfsm.states import RequestState


@runtime_checkable
class EngineTables(Protocol):
    """What the check reads of an engine: its own block tables, never kvfsm's records of them."""

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting, running, loading, or held for kvfsm after it ended."""
        ...

    def block_tables(self) -> Mapping[str, Sequence[int]]:
        """Each request holding GPU blocks now (its request id) -> the GPU block ids it holds."""
        ...

    def free_blocks(self) -> Collection[int]:
        """The GPU blocks the allocator may hand out now, hence that compute may write at any time."""
        ...


class IntegrationWorld(ConnectorWorld):
    """kvfsm's `World` for an engine: the connector's records, the engine's tables and idleness, and the access log
    of `devices[0]` (on `SimDevice`; empty on CUDA). The world is idle once the engine has no work, every device
    in `devices` ran everything enqueued and the lower tiers moved everything they were asked to."""

    def __init__(self, connector: Connector | SchedulerConnector, engine: EngineTables,
                 devices: Device | Sequence[Device] = ()) -> None:
        super().__init__(connector.scheduler if isinstance(connector, Connector) else connector)
        self.connector = connector
        self.engine = engine
        self.devices: list[Device] = list(devices) if isinstance(devices, Sequence) else [devices]

    @property
    def idle(self) -> bool:
        tiers = self.scheduler.tiers
        return (not self.engine.has_work and all(getattr(device, "idle", True) for device in self.devices)
                and (tiers is None or tiers.idle))

    @property
    def accesses(self) -> Sequence[Access]:
        return getattr(self.devices[0], "accesses", ()) if self.devices else ()

    @property
    def rank(self) -> int:
        """The rank whose device `devices[0]` is (rank 0 where the connector is the scheduler half alone)."""
        workers = self.connector.workers if isinstance(self.connector, Connector) else []
        return next((w.worker for w in workers if self.devices and w.device is self.devices[0]), 0)

    @property
    def tiers(self) -> Sequence[TierView]:
        return self.connector.worker.lower_tiers if isinstance(self.connector, Connector) else ()


def fence_in_tables(world: IntegrationWorld) -> list[str]:
    """`fence` read from the engine's tables. A store kvfsm has not flushed (pending-store or submitted) may read
    its GPU blocks until it is done, so each must stay held by the store's request; a flushed store's blocks are
    free to reuse, because `handle_preemptions` waits for it before anything can write them. Blocks the engine took
    back while a store reads them are the exception: a returned request's, and those a running request's sliding
    window left behind (`slide`); the step that hands one out flushes the store (`lazy-fence`, `window-fence`, checked
    on the connector's records)."""
    free = set(world.engine.free_blocks())
    tables = world.engine.block_tables()
    found = []
    for job in world.jobs.values():
        if job.kind != "store" or job.state not in FLUSHABLE_JOB_STATES:
            continue
        owner = world.requests.get(job.req_id)
        if owner is not None and owner.state == RequestState.RETURNED:
            continue
        held = set(tables.get(job.req_id, ()))
        for block in job.gpu_blocks:
            if owner is not None and block in owner.slid:
                continue
            if block in free:
                found.append(f"GPU block {block} is free in the engine while store job {job.job_id} of "
                             f"{job.req_id} still reads it")
            elif block not in held:
                found.append(f"GPU block {block} is not in {job.req_id}'s block table while its store job "
                             f"{job.job_id} still reads it")
    return found


class IntegrationCheck(RunChecks):
    """Every named invariant, the trace and `fence` from the engine's tables, after each step of your engine.

    Build it once the caches are registered and before the first step; call `after_step(step)` after each step
    (with `SimDevice`, after letting the device run what it should); it raises `InvariantViolation` naming every
    broken invariant. Once the engine and devices are idle the same call checks that everything drained."""

    def __init__(self, connector: Connector | SchedulerConnector, engine: EngineTables,
                 devices: Device | Sequence[Device] = ()) -> None:
        self.integration = IntegrationWorld(connector, engine, devices)
        super().__init__(self.integration, connector.machines)

    def violations(self) -> dict[str, list[str]]:
        found = super().violations()
        if tables := fence_in_tables(self.integration):
            found["fence"] = found.get("fence", []) + tables
        return found
