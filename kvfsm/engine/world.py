"""The reference engine through `kvfsm.checking`: its block tables, and the `World` its runs are checked on.

The reference engine is checked the way any engine can check its integration (`kvfsm.checking.integration`):
`ReferenceTables` is its side of the `EngineTables` protocol, and `EngineWorld` the resulting world, reading the
device log of rank 0 unless told another rank's.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from kvfsm.checking.integration import IntegrationWorld
from kvfsm.connector import Connector, SchedulerConnector
from kvfsm.engine.engine import Engine
from kvfsm.executor.device import Device


class ReferenceTables:
    """`EngineTables` of the reference engine: a request's blocks, and the pool's blocks that no request holds."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def block_tables(self) -> Mapping[str, Sequence[int]]:
        return {req_id: request.blocks for req_id, request in self.engine.live.items() if request.blocks}

    def free_blocks(self) -> list[int]:
        return [block for block, refs in enumerate(self.engine.pool.refs) if refs == 0]


class EngineWorld(IntegrationWorld):
    """A live view of the reference engine, its connector and a device: every attribute reads the current state,
    so one instance serves a whole run. The device log is rank 0's unless `device` names another rank's (the
    ordering invariants hold on each rank's device); idle means every local rank's device is. `connector` is both
    halves, or the scheduler half alone (the other ranks' halves in other processes)."""

    def __init__(self, engine: Engine, connector: Connector | SchedulerConnector, device: Device | None = None) -> None:
        read = device or engine.device
        local = [rank.device for rank in engine.ranks.local] if engine.ranks else [engine.device]
        super().__init__(connector, ReferenceTables(engine), [read] + [d for d in local if d is not read])
        self.device = read
