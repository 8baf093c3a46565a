"""`fetch-waits-for-room`: a prefix a lower tier holds, met while every CPU slot a fetch could claim is busy, waits
for the jobs holding them instead of being answered as a miss (which recomputes a prefix the tier holds); a prefix
the pool could never hold is not waited for. The planner alone over a disk tier (`Below`, as in
test_tier_planner.py); the control is the planner that answers a busy pool as a miss."""

from __future__ import annotations

from typing import Callable

from kvfsm.connector.tier_planner import TierPlanner
from test_tier_planner import Below, below  # noqa: F401 (the fixture)


def busy_pool(b: Below) -> int:
    """Fill the two-slot pool with a store in flight (job 1): nothing evictable until it ends; its job id."""
    assert b.manager.prepare_store([8, 9], 1) is not None
    return 1


def answers_a_busy_pool_as_a_miss(planner: TierPlanner) -> None:
    """The control: no slot to claim, no fetch and nothing to defer on (the rule removed)."""
    planner._room_blockers = lambda wanted: frozenset()  # type: ignore[method-assign]


def waits_for_room(b: Below) -> bool:
    """The rule's check: a tier hit met with the pool busy defers on the job holding the pool, and is fetched (and
    nothing else ordered) once that job ended."""
    store = busy_pool(b)
    b.publish("near", [1, 2])
    if b.planner.fetch_missing([1, 2], 0, step=0) != {store} or b.planner.orders(0) != ():
        return False
    slots = [b.manager.catalogue[8], b.manager.catalogue[9]]
    b.manager.mark_submitted(slots)
    b.manager.complete_store(slots, True)  # the store ended: its slots are ready, evictable
    deferred = b.planner.fetch_missing([1, 2], 0, step=1)
    orders = b.planner.orders(1)
    return [(o.kind, o.keys) for o in orders] == [("fetch", (1, 2))] and deferred == {orders[0].job_id}


def test_a_tier_hit_that_finds_every_cpu_slot_busy_defers_on_their_jobs_then_is_fetched(
        below: Callable[..., Below]) -> None:
    b = below("eager", cpu_blocks=2)
    assert waits_for_room(b)
    assert b.planner.stats.room_waits == 1


def test_the_control_that_answers_a_busy_pool_as_a_miss_is_caught(below: Callable[..., Below]) -> None:
    b = below("eager", cpu_blocks=2)
    answers_a_busy_pool_as_a_miss(b.planner)
    assert not waits_for_room(b)


def test_a_tier_hit_longer_than_the_cpu_pool_is_not_waited_for(below: Callable[..., Below]) -> None:
    b = below("eager", cpu_blocks=2)
    busy_pool(b)
    b.publish("near", [1, 2, 3])
    assert b.planner.fetch_missing([1, 2, 3], 0, step=0) == frozenset()
    assert b.planner.stats.room_waits == 0
