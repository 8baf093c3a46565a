"""The manager's generated state machine: random sequences of manager calls, checked after every call.

One hypothesis state machine drives the manager as the connector would (stores prepared, submitted and completed or
failed, loads pinned and released, lookups, touches, resets at any moment) and checks after every call the spec's
`readers-pin`, `ready-means-written` and `pool-accounting`, plus the manager's own promises: a refused store
changes nothing, a store never evicts its own prefix or a pinned block, the policy holds exactly the readable slots,
the events replay to the readable catalogue, and once every transfer ended no slot leaked. The manager's tests run it
with each built-in policy, and the policy conformance suite (`kvfsm.testing.conformance`) with any policy.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Callable, Sequence

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfsm.invariants import pool_accounting, readers_pin, ready_means_written
from kvfsm.manager import BlockRemoved, BlockStored, Lookup, NotLoadable, OffloadingManager
from kvfsm.manager.policies import ArcPolicy, EvictionPolicy

POOL = 3  # small enough that stores keep needing eviction and refusals happen
hashes = st.lists(st.integers(0, 6), unique=True, min_size=1, max_size=3)
MakeManager = Callable[[int], OffloadingManager]


def world(manager: OffloadingManager) -> SimpleNamespace:
    return SimpleNamespace(
        cpu_blocks=manager.blocks, catalogue=manager.catalogue, jobs={}, requests={}, gpu_blocks={},
        deferrals={}, accesses=[], reported_failed=set(), idle=False,
    )


def policy_state(policy: EvictionPolicy) -> object:
    """What a policy holds, comparable before and after a call: its pickle, or (a policy that cannot be pickled)
    the order in which it would give up every slot it holds."""
    try:
        return pickle.dumps(policy)
    except (pickle.PicklingError, TypeError, AttributeError):
        return len(policy), policy.victims(len(policy), lambda _slot: True) if len(policy) else None


def snapshot(manager: OffloadingManager) -> tuple:
    """Everything a refused call must leave alone."""
    blocks = tuple((b.state, b.readers, b.block_hash) for b in manager.blocks)
    return blocks, tuple(manager.catalogue.items()), policy_state(manager.policy)


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
                try:
                    manager.prepare_load(keys)
                except NotLoadable:
                    assert snapshot(manager) == before, "a refused load changed the pool"
                else:
                    raise AssertionError(f"prepare_load({keys}) pinned a block that is not ready")

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

        @rule(data=st.data())
        def store_completes_at_once(self, data: st.DataObject) -> None:
            """A store prepared, submitted and done before anything else happens, as most are: it fills the pool
            with ready blocks, so later stores must evict."""
            keys = self._keys(data)
            self.job += 1
            plan = self.manager.prepare_store(keys, job_id=self.job)
            if plan is not None and plan.slots:
                self.manager.mark_submitted(plan.slots)
                self.manager.complete_store(plan.slots, True)

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
            assert not self.manager.catalogue
            assert len(self.manager.policy) == 0, f"holds-readable: {len(self.manager.policy)} slots held after a reset"

        @invariant()
        def spec_invariants_hold(self) -> None:
            w = world(self.manager)
            for check in (readers_pin, ready_means_written, pool_accounting):
                assert check(w) == [], check(w)

        @invariant()
        def policy_holds_exactly_the_readable_slots(self) -> None:
            readable = {b.slot for b in self.manager.blocks if b.state in ("ready", "loading")}
            held = held_slots(self.manager)
            assert held == readable, f"holds-readable: holds {sorted(held)}, the readable slots are {sorted(readable)}"
            assert len(self.manager.policy) <= self.manager.capacity, "holds-readable: more slots than the pool"
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
