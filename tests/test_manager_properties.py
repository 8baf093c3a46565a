"""Random sequences of manager calls, every built-in policy: the pool's invariants hold after every call.

The state machine (`kvfsm.testing.manager_calls`) drives the manager as the connector would and checks after every
call the spec's `readers-pin`, `ready-means-written` and `pool-accounting`, plus the manager's own promises. Each
control below breaks one rule and must make the same machine fail.
"""

from __future__ import annotations

from typing import Sequence

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvfsm.machines import IllegalTrigger
from kvfsm.manager import Lookup, OffloadingManager, PolicyViolation
from kvfsm.testing.manager_calls import MakeManager, manager_machine
from kvfsm.testing.policy_controls import IgnoresPins

TestLruManagerCalls = manager_machine(lambda n: OffloadingManager(n, "lru")).TestCase
TestArcManagerCalls = manager_machine(lambda n: OffloadingManager(n, "arc")).TestCase
TestS3FifoManagerCalls = manager_machine(lambda n: OffloadingManager(n, "s3-fifo")).TestCase
TestTinyLfuManagerCalls = manager_machine(lambda n: OffloadingManager(n, "tinylfu")).TestCase
TestLruManagerCallsRoomier = manager_machine(lambda n: OffloadingManager(n, "lru"), pool=7).TestCase
TestArcManagerCallsRoomier = manager_machine(lambda n: OffloadingManager(n, "arc"), pool=7).TestCase
TestS3FifoManagerCallsRoomier = manager_machine(lambda n: OffloadingManager(n, "s3-fifo"), pool=7).TestCase
TestTinyLfuManagerCallsRoomier = manager_machine(lambda n: OffloadingManager(n, "tinylfu"), pool=7).TestCase


# controls --------------------------------------------------------------------------------------------------


class CountsSubmitted(OffloadingManager):
    """Control: a lookup that counts blocks whose store is still in flight."""

    def lookup(self, hashes: Sequence[int]) -> Lookup:
        hits = 0
        for key in hashes:
            slot = self.catalogue.get(key)
            if slot is None or self.blocks[slot].state not in ("ready", "submitted"):
                break
            hits += 1
        return Lookup(hits, ())


class EvictsBeforeRefusing(OffloadingManager):
    """Control: makes room one victim at a time, so a store that does not fit still evicts."""

    def _make_room(self, n: int, protected: set[int]) -> bool:
        while n and super()._make_room(1, protected):
            n -= 1
        return n == 0


class EvictsItsOwnPrefix(OffloadingManager):
    """Control: may evict a catalogued block whose hash is part of the store being planned."""

    def _make_room(self, n: int, protected: set[int]) -> bool:
        return super()._make_room(n, set())


class TrustsEnqueuedStores(OffloadingManager):
    """Control: a store whose copy was enqueued is taken as done even when it failed."""

    def complete_store(self, slots: Sequence[int], success: bool) -> None:
        enqueued = all(self.blocks[s].state == "submitted" for s in slots)
        super().complete_store(slots, success or enqueued)


class ResetKeepsInFlight(OffloadingManager):
    """Control: a reset that drops the catalogue but leaves in-flight blocks as they were."""

    def reset(self) -> None:
        readable = [b for b in self.blocks if b.state in ("ready", "loading")]
        self._machine.fire_many(readable, "reset")
        self._free.extend(b.slot for b in readable if b.state == "free")
        self.catalogue.clear()
        self.policy.clear()


CONTROLS: dict[str, MakeManager] = {
    "lookup-counts-submitted": lambda n: CountsSubmitted(n, "lru"),
    "refusal-evicts": lambda n: EvictsBeforeRefusing(n, "arc"),
    "evicts-own-prefix": lambda n: EvictsItsOwnPrefix(n, "lru"),
    "failed-store-ready": lambda n: TrustsEnqueuedStores(n, "arc"),
    "policy-ignores-pins": lambda n: OffloadingManager(n, IgnoresPins(n)),
    "reset-keeps-in-flight": lambda n: ResetKeepsInFlight(n, "lru"),
}

FIND = settings(max_examples=1000, phases=[Phase.generate], database=None, derandomize=True)


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_control_is_caught(control: str) -> None:
    with pytest.raises((AssertionError, IllegalTrigger, PolicyViolation)):
        run_state_machine_as_test(manager_machine(CONTROLS[control]), settings=FIND)
