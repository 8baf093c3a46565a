"""What a device access log records: which actor read or wrote which block, in which memory, in which order.

These types belong to the executor (the simulator logs accesses, the CUDA device names its actors) and know
nothing of lifecycles; the ordering invariants in `kvfsm.invariants` read the log, so they import from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Actor = Literal["compute", "store", "load"]
Mode = Literal["read", "write"]
Space = Literal["gpu", "cpu"]


@dataclass(frozen=True, slots=True)
class Access:
    """One block touched by one executed device operation."""

    issued: int  # host issue order of the operation
    executed: int  # device execution order of the operation
    actor: Actor
    mode: Mode
    space: Space
    block: int
    label: str  # e.g. "compute step 3", "store job 7"
    layer: int | None = None  # the layer segment touched; None: every layer of the block
