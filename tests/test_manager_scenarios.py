"""One behaviour of `OffloadingManager` per test; each safety rule is also run against a control that breaks it."""

from __future__ import annotations

from typing import Sequence

import pytest

from kvfsm.machines import IllegalTrigger
from kvfsm.manager import (
    BadPoolSize,
    BadSlots,
    BlockRemoved,
    BlockStored,
    DuplicateHashes,
    Lookup,
    NotLoadable,
    OffloadingManager,
    PolicyViolation,
    StorePlan,
    UnknownEvictionPolicy,
    make_policy,
)
from kvfsm.testing.manager_calls import snapshot
from kvfsm.testing.policy_controls import IgnoresPins
from test_manager_properties import CountsSubmitted, EvictsBeforeRefusing, EvictsItsOwnPrefix, TrustsEnqueuedStores

POLICIES = ["lru", "arc", "s3-fifo", "s3-fifo-adaptive", "tinylfu"]


def stored(manager: OffloadingManager, hashes: Sequence[int], job_id: int = 1) -> StorePlan:
    """Run one store to completion, as the connector would over two engine steps."""
    plan = manager.prepare_store(hashes, job_id)
    assert plan is not None
    manager.mark_submitted(plan.slots)
    manager.complete_store(plan.slots, True)
    return plan


def states(manager: OffloadingManager) -> list[str]:
    return [b.state for b in manager.blocks]


# lookup ----------------------------------------------------------------------------------------------------


def check_lookup_ignores_blocks_in_flight(manager: OffloadingManager) -> None:
    stored(manager, [1, 2])
    plan = manager.prepare_store([1, 2, 3], job_id=2)
    assert plan is not None
    manager.mark_submitted(plan.slots)
    assert manager.lookup([1, 2, 3]).hits == 2, "a block whose store is in flight was counted"


@pytest.mark.parametrize("policy", POLICIES)
def test_lookup_never_counts_a_block_whose_store_is_in_flight(policy: str) -> None:
    check_lookup_ignores_blocks_in_flight(OffloadingManager(4, policy))  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        check_lookup_ignores_blocks_in_flight(CountsSubmitted(4))


def test_lookup_stops_at_the_first_hash_not_catalogued() -> None:
    manager = OffloadingManager(4)
    stored(manager, [1, 2])
    stored(manager, [4], job_id=2)
    assert manager.lookup([1, 2, 3, 4]) == Lookup(hits=2, busy=())


def test_lookup_counts_no_block_after_a_busy_one() -> None:
    manager = OffloadingManager(4)
    stored(manager, [1])
    pending = manager.prepare_store([1, 2, 3], job_id=2)
    assert pending is not None
    manager.mark_submitted(pending.slots[:1])
    manager.complete_store(pending.slots[:1], True)  # 2 is ready, 3 still pending
    manager.mark_submitted(pending.slots[1:])
    assert manager.lookup([1, 2, 3]) == Lookup(hits=2, busy=(pending.slots[1],))
    stored(manager, [9], job_id=3)
    slots = manager.prepare_load([2])
    assert manager.lookup([1, 2, 3]) == Lookup(hits=1, busy=(slots[0], pending.slots[1]))
    manager.complete_store(pending.slots[1:], True)  # 3 is ready again behind the loading 2
    assert manager.lookup([1, 2, 3]) == Lookup(hits=1, busy=slots)


def test_a_block_being_loaded_is_busy_so_a_second_reader_defers() -> None:
    manager = OffloadingManager(2)
    plan = stored(manager, [1])
    manager.prepare_load([1])
    assert manager.lookup([1]) == Lookup(hits=0, busy=plan.slots)
    with pytest.raises(NotLoadable):
        manager.prepare_load([1])


def test_hashes_differing_only_in_the_last_block_share_the_head() -> None:
    manager = OffloadingManager(4)
    stored(manager, [10, 11, 12])
    assert manager.lookup([10, 11, 13]) == Lookup(hits=2, busy=())
    plan = manager.prepare_store([10, 11, 13], job_id=2)
    assert plan is not None and plan.hashes == (13,) and len(plan.slots) == 1


def test_a_hit_in_a_middle_block_counts_nothing() -> None:
    manager = OffloadingManager(4)
    stored(manager, [2, 3])
    assert manager.lookup([1, 2, 3]).hits == 0


# loads -----------------------------------------------------------------------------------------------------


def test_prepare_load_refuses_a_block_that_is_not_ready_and_pins_nothing() -> None:
    manager = OffloadingManager(4)
    stored(manager, [1])
    manager.prepare_store([2], job_id=2)
    before = snapshot(manager)
    for hashes, refusal in (([1, 2], "hash 0x2 cannot be loaded: pending-store"),
                            ([1, 3], "hash 0x3 cannot be loaded: not catalogued")):
        with pytest.raises(NotLoadable) as refused:
            manager.prepare_load(hashes)
        assert str(refused.value) == refusal
    assert snapshot(manager) == before


def test_load_pins_until_its_last_reader_completes() -> None:
    manager = OffloadingManager(2)
    stored(manager, [1])
    slots = manager.prepare_load([1])
    assert states(manager)[slots[0]] == "loading" and manager.blocks[slots[0]].readers == 1
    manager.complete_load(slots)
    assert states(manager)[slots[0]] == "ready" and manager.blocks[slots[0]].readers == 0


def check_readers_are_never_evicted(manager: OffloadingManager) -> None:
    stored(manager, [1])
    stored(manager, [2], job_id=2)
    pinned = manager.prepare_load([1])
    assert manager.prepare_store([3], job_id=3) is not None
    assert manager.blocks[pinned[0]].state == "loading" and manager.catalogue[1] == pinned[0]
    assert 2 not in manager.catalogue
    assert manager.prepare_store([4], job_id=4) is None, "the only ready block left is pinned"


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_with_readers_is_never_evicted(policy: str) -> None:
    check_readers_are_never_evicted(OffloadingManager(2, policy))  # type: ignore[arg-type]
    with pytest.raises((AssertionError, IllegalTrigger, PolicyViolation)):
        check_readers_are_never_evicted(OffloadingManager(2, IgnoresPins(2)))


# stores ----------------------------------------------------------------------------------------------------


def check_refusal_changes_nothing(manager: OffloadingManager) -> None:
    stored(manager, [1])
    stored(manager, [2], job_id=2)
    manager.prepare_load([1])  # pinned; only 2 can go, but the store needs two slots
    manager.take_events()
    before = snapshot(manager)
    assert manager.prepare_store([5, 6], job_id=3) is None
    assert snapshot(manager) == before and manager.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_refusing_changes_nothing(policy: str) -> None:
    check_refusal_changes_nothing(OffloadingManager(2, policy))  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        check_refusal_changes_nothing(EvictsBeforeRefusing(2))


def check_own_prefix_kept(manager: OffloadingManager) -> None:
    stored(manager, [1])
    stored(manager, [2], job_id=2)
    manager.touch([2])  # 1 is now the least recently used: the natural victim, but part of this store
    plan = manager.prepare_store([1, 3], job_id=3)
    assert plan is not None and plan.hashes == (3,)
    assert manager.catalogue.get(1) is not None, "the store evicted its own prefix"


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_never_evicts_a_hash_of_the_same_call(policy: str) -> None:
    check_own_prefix_kept(OffloadingManager(2, policy))  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        check_own_prefix_kept(EvictsItsOwnPrefix(2))


def test_prepare_store_skips_hashes_already_catalogued_in_any_state() -> None:
    manager = OffloadingManager(6)
    stored(manager, [1])
    manager.prepare_store([2], job_id=2)
    plan = manager.prepare_store([1, 2, 3], job_id=3)
    assert plan == StorePlan(hashes=(3,), slots=(2,))


def test_a_store_with_nothing_new_is_an_empty_plan() -> None:
    manager = OffloadingManager(1)
    stored(manager, [1])
    assert manager.prepare_store([1], job_id=2) == StorePlan((), ())


def check_failed_store(manager: OffloadingManager) -> None:
    plan = manager.prepare_store([1, 2], job_id=1)
    assert plan is not None
    manager.mark_submitted(plan.slots)
    manager.take_events()
    manager.complete_store(plan.slots, False)
    assert [manager.blocks[s].state for s in plan.slots] == ["free", "free"]
    assert manager.lookup([1, 2]) == Lookup(0, ()) and not manager.catalogue
    assert manager.take_events() == [], "a failed store was announced"


@pytest.mark.parametrize("policy", POLICIES)
def test_a_failed_store_frees_its_slots_and_is_not_reported_ready(policy: str) -> None:
    check_failed_store(OffloadingManager(2, policy))  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        check_failed_store(TrustsEnqueuedStores(2))


def test_a_store_ends_only_after_it_was_submitted() -> None:
    manager = OffloadingManager(2)
    plan = manager.prepare_store([1], job_id=1)
    assert plan is not None
    with pytest.raises(BadSlots):
        manager.complete_store(plan.slots, False)
    assert states(manager) == ["pending-store", "free"]
    manager.mark_submitted(plan.slots)
    manager.complete_store(plan.slots, False)
    assert states(manager) == ["free", "free"] and manager.prepare_store([1], job_id=2) is not None


# order -----------------------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_stored_block_first() -> None:
    manager = OffloadingManager(3, "lru")
    for job, h in enumerate([1, 2, 3]):
        stored(manager, [h], job_id=job)
    manager.take_events()
    stored(manager, [4], job_id=9)
    assert manager.take_events()[0] == BlockRemoved((1,))


def test_touch_makes_a_hit_most_recent() -> None:
    manager = OffloadingManager(3, "lru")
    for job, h in enumerate([1, 2, 3]):
        stored(manager, [h], job_id=job)
    manager.touch([1])
    manager.take_events()
    stored(manager, [4, 5], job_id=9)
    assert manager.take_events()[0] == BlockRemoved((2, 3))


def test_a_prefix_is_evicted_from_its_tail() -> None:
    manager = OffloadingManager(3, "lru")
    stored(manager, [1, 2, 3])
    manager.take_events()
    stored(manager, [7], job_id=2)
    assert manager.take_events()[0] == BlockRemoved((3,))
    manager.touch([1, 2])
    stored(manager, [8], job_id=3)
    assert manager.take_events()[0] == BlockRemoved((7,))


# events ----------------------------------------------------------------------------------------------------


def test_events_announce_stores_and_evictions_in_order() -> None:
    manager = OffloadingManager(2)
    stored(manager, [1, 2])
    stored(manager, [3], job_id=2)
    assert manager.take_events() == [BlockStored((1, 2)), BlockRemoved((2,)), BlockStored((3,))]
    assert manager.take_events() == []


# reset -----------------------------------------------------------------------------------------------------


def test_reset_frees_ready_blocks_and_announces_them() -> None:
    manager = OffloadingManager(3, "arc")
    stored(manager, [1, 2])
    manager.take_events()
    manager.reset()
    assert states(manager) == ["free"] * 3 and not manager.catalogue and len(manager.policy) == 0
    assert manager.take_events() == [BlockRemoved((1, 2))]


def test_reset_with_stores_in_flight_frees_them_only_when_they_end() -> None:
    manager = OffloadingManager(3)
    submitted = manager.prepare_store([1], job_id=1)
    pending = manager.prepare_store([2], job_id=2)
    assert submitted is not None and pending is not None
    manager.mark_submitted(submitted.slots)
    manager.reset()
    assert states(manager) == ["orphaned", "orphaned", "free"]
    again = manager.prepare_store([1, 2], job_id=3)
    assert again is None, "an orphaned slot was handed to a new store"
    manager.mark_submitted(pending.slots)  # the late submit of a flushed store keeps it orphaned
    manager.complete_store(submitted.slots, True)
    manager.complete_store(pending.slots, True)
    assert states(manager) == ["free"] * 3 and manager.lookup([1]) == Lookup(0, ())
    assert manager.take_events() == [], "a late completion was announced"


def test_reset_with_a_load_in_flight_frees_the_block_after_its_last_reader() -> None:
    manager = OffloadingManager(1)
    stored(manager, [1])
    slots = manager.prepare_load([1])
    manager.reset()
    assert states(manager) == ["orphaned"] and manager.prepare_store([2], job_id=2) is None
    manager.complete_load(slots)
    assert states(manager) == ["free"] and manager.prepare_store([2], job_id=3) is not None


# bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [[0, 0], [5], [-1], [1]])
def test_a_batch_naming_a_bad_slot_raises_and_moves_nothing(slots: list[int]) -> None:
    manager = OffloadingManager(2)
    plan = manager.prepare_store([1], job_id=1)
    assert plan == StorePlan((1,), (0,))
    before = snapshot(manager)
    for call in (manager.mark_submitted, manager.complete_load, lambda s: manager.complete_store(s, True)):
        with pytest.raises(BadSlots):
            call(slots)
    assert snapshot(manager) == before


@pytest.mark.parametrize(("slots", "refusal"), [
    ([0, 0], "submit: a slot is named twice in [0, 0]"),
    ([2], "submit: a slot of [2] is outside the pool of 2"),
    ([-1], "submit: a slot of [-1] is outside the pool of 2"),
    ([0, 1], "submit is illegal for (slot, state) [(1, 'free')]"),
])
def test_a_bad_batch_is_refused_naming_its_trigger_and_slots(slots: list[int], refusal: str) -> None:
    manager = OffloadingManager(2)
    manager.prepare_store([1], job_id=1)
    with pytest.raises(BadSlots) as refused:
        manager.mark_submitted(slots)
    assert str(refused.value) == refusal


def test_a_hash_named_twice_in_one_call_raises() -> None:
    manager = OffloadingManager(2)
    for call in (lambda h: manager.prepare_store(h, 1), manager.prepare_load):
        with pytest.raises(DuplicateHashes) as refused:
            call([1, 1])
        assert str(refused.value) == "a hash is named twice in one call: [1, 1]"
    assert states(manager) == ["free", "free"]


def test_bad_construction_raises() -> None:
    with pytest.raises(UnknownEvictionPolicy) as refused:
        OffloadingManager(2, "mru")
    assert str(refused.value) == ("unknown eviction policy 'mru'; legal: one of ['arc', 'lru', 's3-fifo', "
                                  "'s3-fifo-adaptive', 'tinylfu', 'w-tinylfu'] or an import path package.module:ClassName")
    with pytest.raises(BadPoolSize, match="at least one slot"):
        OffloadingManager(0)
    with pytest.raises(BadPoolSize, match="policy capacity 3 != pool size 2"):
        OffloadingManager(2, make_policy("lru", 3))


def test_usage_counts_every_state_and_sums_to_capacity() -> None:
    manager = OffloadingManager(4)
    stored(manager, [1])
    manager.prepare_store([2], job_id=2)
    manager.prepare_load([1])
    usage = manager.usage()
    assert usage == {"free": 2, "pending-store": 1, "submitted": 0, "ready": 0, "loading": 1, "writing-back": 0,
                     "fetching": 0, "orphaned": 0}
    assert sum(usage.values()) == manager.capacity == 4


def test_an_abandoned_write_back_announces_its_blocks_removed_and_an_abandoned_fetch_announces_nothing() -> None:
    manager = OffloadingManager(4)
    plan = stored(manager, [11, 12])
    manager.take_events()
    manager.pin_for_write_back(plan.slots)
    manager.abandon_write_back(plan.slots)
    assert manager.take_events() == [BlockRemoved((11, 12))]
    fetch = manager.prepare_fetch([21], job_id=7)
    assert fetch is not None
    manager.abandon_fetch(fetch.slots)
    assert manager.take_events() == [], "a fetched block never announced was announced removed"


def test_a_fetch_names_its_job_as_the_writer_of_its_slots() -> None:
    manager = OffloadingManager(4)
    fetch = manager.prepare_fetch([21, 22], job_id=7)
    assert fetch is not None
    assert [manager.blocks[s].writer_job for s in fetch.slots] == [7, 7]


def test_the_pool_refuses_by_name_a_coupled_trigger_it_takes_only_from_its_own_planning() -> None:
    manager = OffloadingManager(4)
    with pytest.raises(BadSlots, match="^evict: the pool takes this trigger only from its own planning calls$"):
        manager.fire("evict", [0])
    assert manager.blocks[0].state == "free"
