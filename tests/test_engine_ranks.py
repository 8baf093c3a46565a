"""The engine's ranks under tensor parallelism: each rank poisons the blocks its step allocated before its forward
pass, as the one-device engine does, so a read the ordering rules should have prevented shows on every rank; and
each rank's operations carry the step they belong to (what a violation's trace names)."""

from __future__ import annotations

from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import TP_SHAPE, Harness

FIRST_STEP = 1


def test_each_rank_poisons_its_new_blocks_and_labels_its_operations_with_the_step() -> None:
    harness = Harness([SimDevice(), SimDevice()], num_gpu_blocks=8, cpu_blocks=6, shape=TP_SHAPE)
    try:
        harness.add_request((11, 12, 13), 1)
        harness.drain()
        for rank in harness.engine.ranks.ranks:  # type: ignore[attr-defined]
            writes = {access.label for access in rank.device.accesses if access.mode == "write"}
            assert {f"poison step {FIRST_STEP}", f"compute step {FIRST_STEP}"} <= writes
    finally:
        harness.close()
