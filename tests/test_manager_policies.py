"""The eviction policies: their selection by name or import path, LRU's and ARC's order and lists, and the bounds
every built-in must keep (S3-FIFO's and W-TinyLFU's own rules: `test_manager_policies_frequency.py`)."""

from __future__ import annotations

from typing import Callable, get_args

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.config import EvictionName, OffloadConfig
from kvfsm.connector import Connector
from kvfsm.executor.sim import SimDevice
from kvfsm.manager import (
    BUILTIN,
    ArcPolicy,
    EvictionPolicy,
    LruPolicy,
    NotAnEvictionPolicy,
    OffloadingManager,
    PolicyViolation,
    S3FifoPolicy,
    TinyLfuPolicy,
    UnknownEvictionPolicy,
    make_policy,
)
from kvfsm.testing.manager_calls import snapshot
from kvfsm.testing.policy_controls import IgnoresPins

CAPACITY = 4


class UnboundedGhosts(ArcPolicy):
    """Control: an ARC that never forgets an evicted hash."""

    def _bound_ghosts(self) -> None:
        pass


class NoAdaptation(ArcPolicy):
    """Control: an ARC whose target never moves."""

    def insert(self, slot: int, block_hash: int) -> None:
        target = self.target
        super().insert(slot, block_hash)
        self.target = target


class NoPromotion(ArcPolicy):
    """Control: an ARC in which a hit refreshes a block inside T1 instead of promoting it."""

    def touch(self, slot: int) -> None:
        if slot in self.t1:
            self.t1.move_to_end(slot)
        else:
            super().touch(slot)


class MruPolicy(LruPolicy):
    """A user's policy, named by import path: the most recent goes first."""

    def victims(self, n: int, evictable: Callable[[int], bool]) -> list[int] | None:
        chosen = [slot for slot in reversed(self.order) if evictable(slot)][:n]
        return chosen if len(chosen) == n else None


class HalfAPolicy(EvictionPolicy):
    """Not a policy: it implements only part of the interface."""

    def insert(self, slot: int, block_hash: int) -> None:
        pass


# selection ------------------------------------------------------------------------------------------------


def test_the_config_names_exactly_the_built_ins() -> None:
    assert set(get_args(EvictionName)) == set(BUILTIN)


@pytest.mark.parametrize("eviction", [*get_args(EvictionName), "test_manager_policies:MruPolicy", "a.b.c:D"])
def test_the_config_takes_a_built_in_name_or_an_import_path(eviction: str) -> None:
    assert OffloadConfig(cpu_blocks=8, eviction=eviction).eviction == eviction


@pytest.mark.parametrize("eviction", ["fifo", "LRU", "a.b.c", ":D", "a b:C", "a:b:c"])
def test_the_config_refuses_any_other_name_saying_what_is_legal(eviction: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="legal: one of lru, arc, s3-fifo, s3-fifo-adaptive, tinylfu, w-tinylfu or an"):
        OffloadConfig(cpu_blocks=8, eviction=eviction)


def test_a_policy_named_by_import_path_serves_the_pool() -> None:
    manager = OffloadingManager(4, "test_manager_policies:MruPolicy")
    assert type(manager.policy) is MruPolicy


@pytest.mark.parametrize(("eviction", "error", "why"), [
    ("no_such_package.policies:Mine", UnknownEvictionPolicy, "cannot be imported: No module named 'no_such_package'"),
    ("kvfsm.manager:NoSuchPolicy", UnknownEvictionPolicy, "has no attribute 'NoSuchPolicy'"),
    ("kvfsm.manager:Lookup", NotAnEvictionPolicy, "legal: a subclass of kvfsm.manager.EvictionPolicy"),
    ("kvfsm.manager:make_policy", NotAnEvictionPolicy, "legal: a subclass of kvfsm.manager.EvictionPolicy"),
    ("test_manager_policies:HalfAPolicy", NotAnEvictionPolicy, "does not implement __contains__, __len__, clear"),
])
def test_the_connector_refuses_what_is_no_policy_before_pinning_a_byte(eviction: str, error: type, why: str) -> None:
    device = SimDevice()
    with pytest.raises(error, match=why):
        Connector(OffloadConfig(cpu_blocks=8, eviction=eviction), device)
    assert device.host_bytes == 0
    with pytest.raises(error):
        make_policy(eviction, 8)


def test_the_manager_refuses_a_victim_it_did_not_offer_and_changes_nothing() -> None:
    manager = OffloadingManager(2, IgnoresPins(2))
    for key in (1, 2):
        plan = manager.prepare_store([key], job_id=key)
        assert plan is not None
        manager.mark_submitted(plan.slots)
        manager.complete_store(plan.slots, True)
    manager.prepare_load([1])  # its slot is the least recent: the one IgnoresPins answers
    before = snapshot(manager)
    with pytest.raises(PolicyViolation, match=r"IgnoresPins.victims\(1\) answered \[0\]; legal: 1 distinct slots"):
        manager.prepare_store([3], job_id=3)
    assert snapshot(manager) == before


# each built-in ----------------------------------------------------------------------------------------------


class UnboundedS3Ghosts(S3FifoPolicy):
    """Control: an S3-FIFO whose ghost queue never forgets."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.ghost_limit = 1 << 30


def evict(policy: EvictionPolicy, n: int, evictable: Callable[[int], bool] = lambda _s: True) -> list[int]:
    """Pick and remove `n` victims, as the manager does once the plan fits."""
    victims = policy.victims(n, evictable)
    assert victims is not None
    for slot in victims:
        policy.remove(slot)
    return victims


def test_lru_picks_in_order_of_last_use() -> None:
    lru = LruPolicy(CAPACITY)
    for slot in range(4):
        lru.insert(slot, 100 + slot)
    lru.touch(0)
    lru.touch(2)
    assert lru.victims(4, lambda _s: True) == [1, 3, 0, 2]


def test_victims_is_a_question_and_none_when_too_few() -> None:
    for policy in (LruPolicy(CAPACITY), ArcPolicy(CAPACITY)):
        policy.insert(0, 100)
        policy.insert(1, 101)
        assert policy.victims(2, lambda s: s != 1) is None
        assert policy.victims(1, lambda s: s != 1) == [0]
        assert len(policy) == 2 and 0 in policy and 1 in policy


def check_promotion(arc: ArcPolicy) -> None:
    arc.insert(0, 100)
    assert list(arc.t1) == [0] and not arc.t2
    arc.touch(0)
    assert not arc.t1 and list(arc.t2) == [0], "a hit did not promote T1 to T2"


def test_arc_a_hit_promotes_a_block_from_t1_to_t2() -> None:
    check_promotion(ArcPolicy(CAPACITY))
    with pytest.raises(AssertionError):
        check_promotion(NoPromotion(CAPACITY))


def test_arc_a_batch_of_stores_or_hits_is_one_insert_or_touch_per_slot_in_order() -> None:
    arc = ArcPolicy(CAPACITY)
    arc.insert_many([(0, 100), (1, 101), (2, 102)])
    arc.touch_many([2, 0])
    assert (arc.t1, list(arc.t2.items())) == ({1: 101}, [(2, 102), (0, 100)])


def test_arc_evicts_t1_before_t2_while_t1_exceeds_its_target() -> None:
    arc = ArcPolicy(CAPACITY)
    for slot in range(3):
        arc.insert(slot, 100 + slot)
    arc.touch(0)  # 0 is in T2; T1 = [1, 2]; target 0
    assert arc.victims(3, lambda _s: True) == [1, 2, 0]


def check_adaptive_target(arc: ArcPolicy) -> None:
    for slot in range(CAPACITY):
        arc.insert(slot, 100 + slot)
    arc.touch(3)
    assert evict(arc, 1) == [0] and list(arc.b1) == [100]
    arc.insert(0, 100)  # stored again while B1 remembers it: T1 was too small
    assert arc.target == 1.0 and 0 in arc.t2 and not arc.b1, "a B1 ghost hit did not grow the target"
    arc.target = 0.0
    victims = evict(arc, 2, lambda s: s in arc.t2)
    assert list(arc.b2) == [100 + s for s in victims]
    arc.target = 2.0
    arc.insert(victims[0], 100 + victims[0])  # a B2 ghost hit: T2 was too small
    assert arc.target == 1.0, "a B2 ghost hit did not shrink the target"


def test_arc_a_ghost_hit_on_insert_adapts_the_target() -> None:
    check_adaptive_target(ArcPolicy(CAPACITY))
    with pytest.raises(AssertionError):
        check_adaptive_target(NoAdaptation(CAPACITY))


def test_arc_clear_forgets_history() -> None:
    arc = ArcPolicy(CAPACITY)
    arc.insert(0, 100)
    evict(arc, 1)
    arc.insert(0, 100)
    arc.clear()
    assert (len(arc), arc.b1, arc.b2, arc.target) == (0, {}, {}, 0.0)


def test_arc_a_b1_ghost_hit_grows_the_target_by_the_ratio_of_b2_to_b1_at_least_one() -> None:
    arc = ArcPolicy(16)
    arc.b1.update(dict.fromkeys([1, 2]))
    arc.b2.update(dict.fromkeys([3, 4, 5, 6]))
    arc.insert(0, 1)
    assert arc.target == 2.0 and arc.t2 == {0: 1}


def test_arc_a_b2_ghost_hit_shrinks_the_target_by_the_ratio_of_b1_to_b2_down_to_zero() -> None:
    arc = ArcPolicy(16)
    arc.b1.update(dict.fromkeys([1, 2, 3, 4]))
    arc.b2.update(dict.fromkeys([5, 6]))
    arc.target = 10.0
    arc.insert(0, 5)
    assert arc.target == 8.0 and arc.t2 == {0: 5}, "a B2 hit must join T2 with its hash"
    arc.b1.clear()
    arc.target = 0.5
    arc.insert(1, 6)
    assert arc.target == 0.0


def test_arc_a_hit_on_a_t2_block_makes_it_the_most_recent_of_t2() -> None:
    arc = ArcPolicy(CAPACITY)
    for slot in range(2):
        arc.insert(slot, 100 + slot)
        arc.touch(slot)
    arc.touch(0)
    assert list(arc.t2) == [1, 0]


def test_arc_forgets_the_oldest_ghost_of_b2_while_t1_and_b1_fit_the_pool() -> None:
    arc = ArcPolicy(2)
    arc.t1[0], arc.t2[1] = 100, 101
    arc.b1[200] = arc.b2[201] = None
    arc.remove(1)  # B2 gains 101: three ghosts for a pool of two, and T1 + B1 is exactly the pool
    assert (list(arc.b1), list(arc.b2)) == ([200], [101])


def test_arc_forgets_the_oldest_ghost_of_b1_while_t1_and_b1_overflow_the_pool() -> None:
    arc = ArcPolicy(2)
    arc.t1[0], arc.t1[1] = 100, 101
    arc.b1[200] = arc.b2[201] = None
    arc.remove(0)  # B1 gains 100: T1 + B1 = 3 > 2
    assert (list(arc.b1), list(arc.b2)) == ([100], [201])


def test_arc_takes_t2_first_once_t1_is_no_larger_than_its_target() -> None:
    arc = ArcPolicy(CAPACITY)
    arc.insert(0, 100)
    arc.insert(1, 101)
    arc.touch(1)
    arc.target = 1.0  # |T1| == target: T1 is not over its share
    assert arc.victims(1, lambda _s: True) == [1]


def test_arc_counts_t1_down_as_it_picks_from_it_and_turns_to_t2_at_the_target() -> None:
    arc = ArcPolicy(CAPACITY)
    for slot in range(4):
        arc.insert(slot, 100 + slot)
    arc.touch(3)  # T1 = [0, 1, 2], T2 = [3]
    arc.target = 1.5
    assert arc.victims(3, lambda _s: True) == [0, 1, 3]


# random sequences ------------------------------------------------------------------------------------------

ops = st.lists(
    st.tuples(st.sampled_from(["insert", "touch", "evict", "clear"]), st.integers(0, CAPACITY - 1),
              st.integers(0, 11), st.frozensets(st.integers(0, CAPACITY - 1))),
    max_size=60,
)


def check_bounds(policy: EvictionPolicy, sequence: list[tuple[str, int, int, frozenset[int]]]) -> None:
    """Victims are held, distinct and evictable; the policy and its ghost lists stay within capacity."""
    for op, slot, key, pinned in sequence:
        if op == "insert" and slot not in policy:
            policy.insert(slot, key)
        elif op == "touch":
            policy.touch(slot)
        elif op == "evict":
            n = 1 + key % CAPACITY
            victims = policy.victims(n, lambda s: s not in pinned)
            if victims is not None:
                assert len(victims) == len(set(victims)) == n
                assert all(v in policy and v not in pinned for v in victims), f"{victims} hits {pinned}"
                for victim in victims:
                    policy.remove(victim)
        elif op == "clear":
            policy.clear()
        assert len(policy) <= policy.capacity
        if isinstance(policy, ArcPolicy):
            assert len(policy.b1) + len(policy.b2) <= policy.capacity, "ghost lists outgrew capacity"
            assert 0 <= policy.target <= policy.capacity
        if isinstance(policy, S3FifoPolicy):
            assert len(policy.ghosts) <= policy.capacity, "ghost queue outgrew the pool"
        if isinstance(policy, TinyLfuPolicy):
            assert len(policy.sketch.table) == 2 * policy.sketch.width, "the sketch grew"


@given(sequence=ops, name=st.sampled_from(sorted(BUILTIN)))
def test_policies_never_pick_a_pinned_slot_and_never_exceed_capacity(sequence: list, name: str) -> None:
    check_bounds(make_policy(name, CAPACITY), sequence)


def test_controls_for_the_bounds_are_caught() -> None:
    insert_all = [("insert", s, 100 + s, frozenset()) for s in range(CAPACITY)]
    with pytest.raises(AssertionError):
        check_bounds(IgnoresPins(CAPACITY), [*insert_all, ("evict", 0, 0, frozenset({0}))])
    # Each round evicts slot 0 and stores a new hash there: one more ghost a round.
    rounds = [op for i in range(CAPACITY + 1)
              for op in (("evict", 0, 0, frozenset()), ("insert", 0, 200 + i, frozenset()))]
    with pytest.raises(AssertionError):
        check_bounds(UnboundedGhosts(CAPACITY), [("insert", 0, 199, frozenset()), *rounds])
    with pytest.raises(AssertionError):
        check_bounds(UnboundedS3Ghosts(CAPACITY), [("insert", 0, 199, frozenset()), *rounds])
