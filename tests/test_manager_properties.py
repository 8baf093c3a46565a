"""Random sequences of manager calls, both policies: the pool's invariants hold after every call.

One state machine drives the manager as the connector would (stores prepared, submitted and completed or failed,
loads pinned and released, lookups, touches, resets at any moment) and checks after every call the spec's
`readers-pin`, `ready-means-written` and `pool-accounting`, plus the manager's own promises. Each control below
breaks one rule and must make the same machine fail.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Sequence

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvfsm.invariants import pool_accounting, readers_pin, ready_means_written
from kvfsm.machines import IllegalTrigger
from kvfsm.manager import ArcPolicy, BlockRemoved, BlockStored, Lookup, LruPolicy, NotLoadable, OffloadingManager

POOL = 3  # small enough that stores keep needing eviction and refusals happen
hashes = st.lists(st.integers(0, 6), unique=True, min_size=1, max_size=3)
MakeManager = Callable[[int], OffloadingManager]


def world(manager: OffloadingManager) -> SimpleNamespace:
    return SimpleNamespace(
        cpu_blocks=manager.blocks, catalogue=manager.catalogue, jobs={}, requests={}, gpu_blocks={},
        deferrals={}, accesses=[], reported_failed=set(), idle=False,
    )


def snapshot(manager: OffloadingManager) -> tuple:
    """Everything a refused call must leave alone."""
    blocks = tuple((b.state, b.readers, b.block_hash) for b in manager.blocks)
    policy = manager.policy
    order = (tuple(policy.order),) if isinstance(policy, LruPolicy) else (
        tuple(policy.t1), tuple(policy.t2), tuple(policy.b1), tuple(policy.b2), policy.target)
    return blocks, tuple(manager.catalogue.items()), order


def held_slots(manager: OffloadingManager) -> set[int]:
    return {s for s in range(manager.capacity) if s in manager.policy}


def manager_machine(make: MakeManager, pool: int = POOL) -> type[RuleBasedStateMachine]:
    class ManagerCalls(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.manager = make(pool)
            self.loads: list[tuple[int, ...]] = []
            self.stores: list[tuple[tuple[int, ...], bool]] = []  # (slots, submitted)
            self.announced: set[int] = set()
            self.job = 0

        def _keys(self, data: st.DataObject) -> list[int]:
            """Hashes for one call, often a run of catalogued ones so that calls meet each other's blocks."""
            known = sorted(self.manager.catalogue)
            if not known:
                return data.draw(hashes)
            mixed = st.lists(st.sampled_from([*known, *range(7)]), unique=True, min_size=1, max_size=3)
            return data.draw(st.one_of(hashes, mixed))

        def _drain_events(self) -> None:
            for event in self.manager.take_events():
                if isinstance(event, BlockStored):
                    assert not self.announced & set(event.hashes), f"announced twice: {event}"
                    self.announced |= set(event.hashes)
                else:
                    assert isinstance(event, BlockRemoved)
                    assert set(event.hashes) <= self.announced, f"removed what was never stored: {event}"
                    self.announced -= set(event.hashes)

        @rule(data=st.data())
        def lookup(self, data: st.DataObject) -> None:
            keys = self._keys(data)
            result = self.manager.lookup(keys)
            blocks, catalogue = self.manager.blocks, self.manager.catalogue
            for key in keys[: result.hits]:
                assert key in catalogue and blocks[catalogue[key]].state == "ready", f"counted {key}: not ready"
            assert result == reference_lookup(self.manager, keys)

        @rule(data=st.data())
        def prepare_load(self, data: st.DataObject) -> None:
            keys = self._keys(data)
            manager = self.manager
            loadable = all(k in manager.catalogue and manager.blocks[manager.catalogue[k]].state == "ready"
                           for k in keys)
            before = snapshot(manager)
            if loadable:
                self.loads.append(manager.prepare_load(keys))
            else:
                with pytest.raises(NotLoadable):
                    manager.prepare_load(keys)
                assert snapshot(manager) == before

        @precondition(lambda self: self.loads)
        @rule(data=st.data())
        def complete_load(self, data: st.DataObject) -> None:
            slots = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
            self.manager.complete_load(slots)

        @rule(data=st.data())
        def prepare_store(self, data: st.DataObject) -> None:
            keys = self._keys(data)
            manager = self.manager
            self.job += 1
            pinned = {b.slot: b.readers for b in manager.blocks if b.readers}
            before = snapshot(manager)
            plan = manager.prepare_store(keys, job_id=self.job)
            if plan is None:
                assert snapshot(manager) == before, "a refused store changed the pool"
                return
            catalogued = dict(before[1])
            assert plan.hashes == tuple(k for k in keys if k not in catalogued)
            assert {b.slot: b.readers for b in manager.blocks if b.readers} == pinned, "a pinned block moved"
            for key in keys:
                if key in catalogued:
                    assert manager.catalogue.get(key) == catalogued[key], f"{key} of this store was evicted"
            if plan.slots:
                self.stores.append((plan.slots, False))

        @precondition(lambda self: any(not submitted for _, submitted in self.stores))
        @rule(data=st.data())
        def mark_submitted(self, data: st.DataObject) -> None:
            pending = [i for i, (_, submitted) in enumerate(self.stores) if not submitted]
            i = data.draw(st.sampled_from(pending))
            self.manager.mark_submitted(self.stores[i][0])
            self.stores[i] = (self.stores[i][0], True)

        @precondition(lambda self: self.stores)
        @rule(data=st.data(), success=st.booleans())
        def complete_store(self, data: st.DataObject, success: bool) -> None:
            i = data.draw(st.integers(0, len(self.stores) - 1))
            slots, submitted = self.stores[i]
            blocks = self.manager.blocks
            if not submitted:  # a store ends (done or failed) only once its copy was submitted
                return
            del self.stores[i]
            orphaned = {s for s in slots if blocks[s].state == "orphaned"}
            hashes_before = {s: blocks[s].block_hash for s in slots}
            self.manager.complete_store(slots, success)
            stored = {h for e in self.manager.take_events() if isinstance(e, BlockStored) for h in e.hashes}
            self.announced |= stored
            for s in slots:
                if s in orphaned or not success:
                    assert blocks[s].state == "free", f"slot {s} is {blocks[s].state} after its store ended"
                    assert hashes_before[s] not in stored and hashes_before[s] not in self.manager.catalogue
                else:
                    assert blocks[s].state == "ready"

        @rule(data=st.data())
        def touch(self, data: st.DataObject) -> None:
            keys = self._keys(data)
            self.manager.touch(keys)

        @rule()
        def reset(self) -> None:
            self.manager.reset()
            assert not self.manager.catalogue and len(self.manager.policy) == 0

        @invariant()
        def spec_invariants_hold(self) -> None:
            w = world(self.manager)
            for check in (readers_pin, ready_means_written, pool_accounting):
                assert check(w) == [], check(w)

        @invariant()
        def policy_holds_exactly_the_readable_slots(self) -> None:
            readable = {b.slot for b in self.manager.blocks if b.state in ("ready", "loading")}
            assert held_slots(self.manager) == readable and len(self.manager.policy) <= self.manager.capacity
            policy = self.manager.policy
            if isinstance(policy, ArcPolicy):
                assert len(policy.b1) + len(policy.b2) <= policy.capacity, "ghost lists outgrew the pool"

        @invariant()
        def events_replay_to_the_readable_catalogue(self) -> None:
            self._drain_events()
            blocks = self.manager.blocks
            readable = {h for h, s in self.manager.catalogue.items() if blocks[s].state in ("ready", "loading")}
            assert self.announced == readable

        def teardown(self) -> None:
            """Once every transfer ended, the whole pool is free or evictable: no slot leaked."""
            manager = self.manager
            if pool_accounting(world(manager)):
                return  # the invariant already failed this run; finishing its transfers would only mask that
            for slots in self.loads:
                manager.complete_load(slots)
            for slots, submitted in self.stores:
                if not submitted:
                    manager.mark_submitted(slots)
                manager.complete_store(slots, False)
            fresh = list(range(100, 100 + manager.capacity))
            assert manager.prepare_store(fresh, job_id=0) is not None, f"slots leaked: {manager.usage()}"

    return ManagerCalls


def reference_lookup(manager: OffloadingManager, keys: Sequence[int]) -> Lookup:
    """The rule as the brief states it: hits = leading ready run; busy = in-flight slots of the catalogued run."""
    run = []
    for key in keys:
        if key not in manager.catalogue:
            break
        run.append(manager.blocks[manager.catalogue[key]])
    hits = next((i for i, b in enumerate(run) if b.state != "ready"), len(run))
    busy = tuple(b.slot for b in run if b.state in ("pending-store", "submitted", "loading"))
    return Lookup(hits, busy)


TestLruManagerCalls = manager_machine(lambda n: OffloadingManager(n, "lru")).TestCase
TestArcManagerCalls = manager_machine(lambda n: OffloadingManager(n, "arc")).TestCase
TestLruManagerCallsRoomier = manager_machine(lambda n: OffloadingManager(n, "lru"), pool=7).TestCase
TestArcManagerCallsRoomier = manager_machine(lambda n: OffloadingManager(n, "arc"), pool=7).TestCase


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


class IgnoresPins(LruPolicy):
    """Control: an LRU that does not ask whether a slot may be evicted."""

    def victims(self, n: int, evictable: Callable[[int], bool]) -> list[int] | None:
        return super().victims(n, lambda _slot: True)


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
    with pytest.raises((AssertionError, IllegalTrigger)):
        run_state_machine_as_test(manager_machine(CONTROLS[control]), settings=FIND)
