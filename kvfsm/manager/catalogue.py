"""The scheduler's catalogue of the host pool: which prefix hash lives in which CPU slot, and in what state.

Every state change goes through the spec's `cpu-block` machine; this module decides only which blocks to move
and keeps its indexes (catalogue, free slots, policy, events) in step with the states the machine produced.
Each batch call checks all of its slots before firing on any, so bad input raises a named error and moves
nothing, rather than leaving the indexes half updated.

Prefix order: a block's hash covers its whole prefix, so a later block is useless once an earlier one is gone.
Stores and hits therefore enter the policy head last: the head of a prefix is the most recent, and a prefix is
evicted from its tail.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import filterfalse
from operator import attrgetter
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from kvfsm.bindings import default_spec
from kvfsm.machines import LifecycleMachine, MachineSet
from kvfsm.manager.events import BlockRemoved, BlockStored, KVCacheEvent
from kvfsm.manager.policies import EvictionPolicy, make_policy
from kvfsm.records import CpuBlock
from kvfsm.states import CpuBlockState

READY, LOADING, FREE = CpuBlockState.READY, CpuBlockState.LOADING, CpuBlockState.FREE
WRITING_BACK, FETCHING = CpuBlockState.WRITING_BACK, CpuBlockState.FETCHING
READABLE = frozenset({READY, LOADING, WRITING_BACK})  # catalogued and holding their bytes: counted by the policy
BUSY = frozenset({CpuBlockState.PENDING_STORE, CpuBlockState.SUBMITTED, LOADING, WRITING_BACK, FETCHING})
"""A lookup that meets one of these defers."""
_STATE, _HASH = attrgetter("state"), attrgetter("block_hash")


_COUPLED: dict[str, tuple[str, tuple[bool, ...]]] = {
    "submit": ("mark_submitted", ()),
    "store-done": ("complete_store", (True,)),
    "store-failed": ("complete_store", (False,)),
    "unpin": ("complete_load", ()),
    "written-back": ("complete_write_back", ()),
    "fetch-done": ("complete_fetch", (True,)),
    "fetch-failed": ("complete_fetch", (False,)),
    "abandon-fetch": ("abandon_fetch", ()),
    "abandon-write-back": ("abandon_write_back", ()),
}
"""cpu-block triggers a coupling may fire (a transfer job's or a tier job's), and the method that fires each with its
index updates."""


class ManagerError(RuntimeError):
    """A manager call that would break the pool's bookkeeping; nothing was changed."""


class NotLoadable(ManagerError):
    """`prepare_load` named a hash that is not catalogued as ready."""


class BadSlots(ManagerError, ValueError):
    """A batch named a slot outside the pool, named one twice, or named one whose state refuses the trigger."""


class BadPoolSize(ManagerError, ValueError):
    """A pool of no slots, or an eviction policy sized for another pool."""


class PolicyViolation(ManagerError):
    """The eviction policy answered `victims` against its contract (`kvfsm.manager.policies.base`): too many or too
    few slots, one twice, or one the manager did not offer (pinned, loading, storing, written back, planned)."""


class DuplicateHashes(ManagerError, ValueError):
    """One call named the same prefix hash twice; a hash chain never repeats, so the caller is confused."""


class Lookup(NamedTuple):
    """`hits`: leading blocks that are ready; `busy`: slots of the leading catalogued run someone is moving. A named
    tuple: one is made per lookup, a deferred request's every step (see `kvfsm.invariants.Deferral`)."""

    hits: int
    busy: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StorePlan:
    """The hashes a store writes (those not yet catalogued, in input order) and the slot each one got."""

    hashes: tuple[int, ...]
    slots: tuple[int, ...]


class OffloadingManager:
    """The host pool's catalogue, addressed by CPU-block hashes; one instance per scheduler."""

    def __init__(self, num_slots: int, policy: str | EvictionPolicy = "lru",
                 machines: MachineSet | None = None, events: bool = True) -> None:
        """`policy`: a policy, or its name or import path (`kvfsm.manager.policies.factory`). `events`: keep
        `BlockStored`/`BlockRemoved` for `take_events`; off for an engine that never takes them, whose buffer would
        otherwise grow for as long as it runs."""
        if num_slots <= 0:
            raise BadPoolSize(f"the pool needs at least one slot, got {num_slots}")
        self.blocks: list[CpuBlock] = [CpuBlock(slot) for slot in range(num_slots)]
        self.catalogue: dict[int, int] = {}
        self.policy: EvictionPolicy = make_policy(policy, num_slots) if isinstance(policy, str) else policy
        if self.policy.capacity != num_slots:
            raise BadPoolSize(f"policy capacity {self.policy.capacity} != pool size {num_slots}; legal: equal sizes")
        self._machine: LifecycleMachine = (machines or MachineSet(default_spec()))["cpu-block"]
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot is handed out first
        self._events: list[KVCacheEvent] = []
        self._keep_events = events
        self.version = 0
        """Changes with every transition of a block and every call that reorders the policy: a plan read from the
        pool's states and eviction order (the on-evict write-back look-ahead) still holds while it is unchanged."""
        self._sources = {
            trigger: frozenset(s for s in self._machine.lifecycle.states if self._machine.lifecycle.branches(s, trigger))
            for trigger in self._machine.lifecycle.triggers
        }

    def _fire_many(self, blocks: Sequence[CpuBlock], trigger: str, **context: Any) -> None:
        """Every block transition of the pool, counted in `version`."""
        self.version += 1
        self._machine.fire_many(blocks, trigger, **context)

    def fire(self, trigger: str, slots: Sequence[int], **_: Any) -> None:
        """A coupling's entry: a job's transition moves its slots (the ledger calls this; see `spec/`).

        Each coupled trigger goes through the method that keeps the indexes that transition implies (looked up
        by name at call time, so a patched method, as a mutant patches it, is the one used)."""
        if trigger not in _COUPLED:
            raise BadSlots(f"{trigger}: the pool takes this trigger only from its own planning calls")
        method, args = _COUPLED[trigger]
        getattr(self, method)(slots, *args)

    @property
    def capacity(self) -> int:
        return len(self.blocks)

    # lookups and loads -------------------------------------------------------------------------------------

    def lookup(self, hashes: Iterable[int], every_busy: bool = True) -> Lookup:
        """Leading ready hits and the busy slots after them; `every_busy=False` stops at the first busy slot.

        A scheduler that only needs to know whether to defer (and whom it waits for) asks for the first: a request
        deferred behind a long prefix someone is storing then costs its hits and one block per step, not the prefix.
        """
        blocks, catalogue = self.blocks, self.catalogue
        hits = 0
        counting = True
        busy: list[int] = []
        for block_hash in hashes:
            slot = catalogue.get(block_hash)
            if slot is None:
                break
            state = blocks[slot].state
            if counting and state == READY:
                hits += 1
                continue
            counting = False
            if state in BUSY:
                busy.append(slot)
                if not every_busy:
                    break
        return Lookup(hits, tuple(busy))

    def prepare_load(self, hashes: Sequence[int], job_id: int | None = None) -> tuple[int, ...]:
        """Pin the ready blocks of `hashes` for one load (`job_id`); the caller releases them with `complete_load`."""
        self._require_distinct(hashes)
        blocks, catalogue = self.blocks, self.catalogue
        slots = tuple(map(catalogue.get, hashes))
        picked = [blocks[s] for s in slots] if None not in slots else []
        if len(picked) != len(slots) or [b for b in picked if b.state != READY]:
            block_hash, slot = next((h, s) for h, s in zip(hashes, slots) if s is None or blocks[s].state != READY)
            state = "not catalogued" if slot is None else blocks[slot].state
            raise NotLoadable(f"hash {block_hash:#x} cannot be loaded: {state}")
        self._fire_many(picked, "pin", job_id=job_id)
        return slots  # type: ignore[return-value]

    def complete_load(self, slots: Sequence[int]) -> None:
        picked = self._picked(slots, "unpin")
        self._fire_many(picked, "unpin")
        self._free.extend([b.slot for b in picked if b.state == FREE])  # orphaned by a reset while loading

    def touch(self, hashes: Sequence[int]) -> None:
        """A hit on `hashes`: refresh their readable blocks in the policy, head of the prefix last."""
        blocks = self.blocks
        self.version += 1
        self.policy.touch_many([slot for slot in map(self.catalogue.get, reversed(hashes))
                                if slot is not None and blocks[slot].state in READABLE])

    # stores ------------------------------------------------------------------------------------------------

    def prepare_store(self, hashes: Sequence[int], job_id: int) -> StorePlan | None:
        """Claim a slot for each uncatalogued hash, evicting if needed; None (and no change) when they don't fit."""
        return self._claim(hashes, job_id, "allocate")

    def prepare_fetch(self, hashes: Sequence[int], job_id: int) -> StorePlan | None:
        """Claim a fetching slot for each uncatalogued hash, for a fetch from a lower tier; None when they don't fit."""
        return self._claim(hashes, job_id, "allocate-fetch")

    def _claim(self, hashes: Sequence[int], job_id: int, trigger: str) -> StorePlan | None:
        self._require_distinct(hashes)
        catalogue = self.catalogue
        new = tuple(filterfalse(catalogue.__contains__, hashes))
        shortfall = len(new) - len(self._free)
        if shortfall > 0 and not self._make_room(shortfall, {catalogue[h] for h in hashes if h in catalogue}):
            return None
        free, blocks = self._free, self.blocks
        slots = tuple(free[:-len(new) - 1:-1])  # popped from the stack's top, in order
        del free[len(free) - len(new):]
        self._fire_many([blocks[s] for s in slots], trigger, hashes=dict(zip(slots, new)), job_id=job_id)
        catalogue.update(zip(new, slots))
        return StorePlan(new, slots)

    def _make_room(self, n: int, protected: set[int]) -> bool:
        """Evict `n` unpinned ready blocks outside `protected`, or evict nothing and say so."""
        blocks = self.blocks
        def evictable(slot: int) -> bool:
            return slot not in protected and blocks[slot].state == READY

        victims = self.policy.victims(n, evictable)
        if victims is None:
            return False
        self._check_victims(n, victims, evictable)
        picked = [blocks[s] for s in victims]
        hashes = tuple(b.block_hash for b in picked)  # read before `evict` forgets them
        self._fire_many(picked, "evict")
        for slot, block_hash in zip(victims, hashes):
            self.policy.remove(slot)
            del self.catalogue[block_hash]
        self._free.extend(victims)
        if self._keep_events:
            self._events.append(BlockRemoved(hashes))  # type: ignore[arg-type]
        return True

    def _check_victims(self, n: int, victims: Sequence[int], evictable: Callable[[int], bool]) -> None:
        """The policy's answer, refused before anything moves unless it is `n` distinct slots the manager offered.
        The spec refuses evicting a loading or in-flight block on its own; this also catches a ready block of the
        store being planned, which the spec would let go, and names the policy."""
        if len(victims) != n or len(set(victims)) != n or not all(map(evictable, victims)):
            raise PolicyViolation(f"{type(self.policy).__name__}.victims({n}) answered {list(victims)}; legal: {n} "
                                  "distinct slots it was offered (ready, unpinned, outside the store planned)")

    def mark_submitted(self, slots: Sequence[int]) -> None:
        self._fire_many(self._picked(slots, "submit"), "submit")

    def complete_store(self, slots: Sequence[int], success: bool) -> None:
        """End a store: its blocks become ready, or free and forgotten; orphaned slots go free either way."""
        self._complete_write(slots, "store-done" if success else "store-failed")

    def complete_fetch(self, slots: Sequence[int], success: bool) -> None:
        """End a fetch's slots: ready with the fetched bytes, or free and forgotten (the lookup will miss)."""
        self._complete_write(slots, "fetch-done" if success else "fetch-failed")

    def abandon_fetch(self, slots: Sequence[int]) -> None:
        """A fetch failed at its deadline while its read may still land: its slots leave the catalogue as orphaned,
        held (never free, loadable or reused) until `complete_fetch` frees them once the read returned (slots a cache
        reset orphaned already stay so)."""
        self._abandon(slots, "abandon-fetch")

    def abandon_write_back(self, slots: Sequence[int]) -> None:
        """A write-back failed at its deadline while its write may still read the slots: they leave the catalogue
        (a lookup misses them instead of waiting on a hung disk) as orphaned, held until `complete_write_back`."""
        self._abandon(slots, "abandon-write-back")

    def _abandon(self, slots: Sequence[int], trigger: str) -> None:
        picked = self._picked(slots, trigger)
        dropped = [(b.slot, b.block_hash) for b in picked if b.block_hash is not None]  # orphaned ones name none
        self._fire_many(picked, trigger)
        for slot, block_hash in dropped:
            del self.catalogue[block_hash]  # type: ignore[arg-type]
            if slot in self.policy:
                self.policy.remove(slot)
        if dropped and trigger == "abandon-write-back" and self._keep_events:
            self._events.append(BlockRemoved(tuple(h for _, h in dropped)))  # type: ignore[arg-type]

    def pin_for_write_back(self, slots: Sequence[int]) -> None:
        """Pin ready blocks while a write-back reads them: not evicted, rewritten or loaded until it ends."""
        self._fire_many(self._picked(slots, "write-back"), "write-back")

    def complete_write_back(self, slots: Sequence[int]) -> None:
        """A write-back ended (either way): its blocks are ready again; orphaned ones go free."""
        picked = self._picked(slots, "written-back")
        self._fire_many(picked, "written-back")
        self._free.extend(b.slot for b in picked if b.state == FREE)

    def _complete_write(self, slots: Sequence[int], trigger: str) -> None:
        picked = self._picked(slots, trigger)
        hashes = list(map(_HASH, picked))  # read before a failure forgets them
        self._fire_many(picked, trigger)
        stored = [(b.slot, h) for b, h in zip(picked, hashes) if b.state == READY]
        if len(stored) < len(picked):  # some failed, or were orphaned: free
            for block, block_hash in zip(picked, hashes):
                if block.state == FREE:
                    self._free.append(block.slot)
                    if block_hash is not None:
                        del self.catalogue[block_hash]
        self.policy.insert_many(reversed(stored))  # type: ignore[arg-type]
        if stored and self._keep_events:
            self._events.append(BlockStored(tuple(h for _, h in stored)))  # type: ignore[misc]

    # whole pool --------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop the catalogue: readable-now blocks are announced removed, in-flight ones become orphaned."""
        announced = tuple(h for h, s in self.catalogue.items() if self.blocks[s].state in READABLE)
        resettable = self._sources["reset"]  # every catalogued state; orphaned blocks already left the catalogue
        held = [b for b in self.blocks if b.state in resettable]
        self._fire_many(held, "reset")
        self._free.extend(b.slot for b in held if b.state == FREE)
        self.catalogue.clear()
        self.policy.clear()
        if announced and self._keep_events:
            self._events.append(BlockRemoved(announced))

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def usage(self) -> dict[str, int]:
        """Slots per state, every state of the spec listed."""
        counts = Counter(b.state for b in self.blocks)
        return {state: counts[state] for state in self._machine.lifecycle.states}

    # input checks ------------------------------------------------------------------------------------------

    def _picked(self, slots: Sequence[int], trigger: str) -> list[CpuBlock]:
        """The blocks of `slots`, once every one of them is a distinct pool slot from which `trigger` is legal."""
        blocks = self.blocks
        if len(set(slots)) != len(slots):
            raise BadSlots(f"{trigger}: a slot is named twice in {list(slots)}")
        if slots and (min(slots) < 0 or max(slots) >= len(blocks)):
            raise BadSlots(f"{trigger}: a slot of {list(slots)} is outside the pool of {len(blocks)}")
        picked = list(map(blocks.__getitem__, slots))
        legal = self._sources[trigger]
        if not legal.issuperset(map(_STATE, picked)):
            refused = [(b.slot, b.state) for b in picked if b.state not in legal]
            raise BadSlots(f"{trigger} is illegal for (slot, state) {refused}")
        return picked

    @staticmethod
    def _require_distinct(hashes: Sequence[int]) -> None:
        if len(set(hashes)) != len(hashes):
            raise DuplicateHashes(f"a hash is named twice in one call: {list(hashes)}")
