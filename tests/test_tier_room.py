"""`fetch-waits-for-room`: a prefix a lower tier holds, met while every CPU slot a fetch could claim is busy, waits
for the jobs holding them instead of being answered as a miss (which recomputes a prefix the tier holds); a prefix
the pool could never hold is not waited for. The planner alone over a disk tier (`Below`, as in
test_tier_planner.py), checked by the planner's orders and by the named invariant; the control `busy-pool-is-miss`
(in `ROOM_CONTROLS`) answers a busy pool as a miss, which both must catch."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

from kvfsm.testing.tier_mutants import ROOM_CONTROLS
from kvfsm.tier_invariants import fetch_waits_for_room
from test_tier_planner import Below, below  # noqa: F401 (the fixture)


def busy_pool(b: Below) -> int:
    """Fill the two-slot pool with a store in flight (job 1): nothing evictable until it ends; its job id."""
    assert b.manager.prepare_store([8, 9], 1) is not None
    return 1


def violations(b: Below) -> list[str]:
    """What `fetch-waits-for-room` finds in the planner's latest lookups."""
    world = SimpleNamespace(cpu_blocks=b.manager.blocks, room_lookups=b.planner.room_lookups)
    return fetch_waits_for_room(world)  # type: ignore[arg-type]


def waits_for_room(b: Below) -> bool:
    """The rule's check: a tier hit met with the pool busy defers on the job holding the pool, and is fetched (and
    nothing else ordered) once that job ended."""
    store = busy_pool(b)
    b.publish("near", [1, 2])
    if b.planner.fetch_missing([1, 2], 0, step=0) != {store} or b.planner.orders(0) != () or violations(b):
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


def test_the_control_that_answers_a_busy_pool_as_a_miss_is_caught_by_the_invariant(
        below: Callable[..., Below]) -> None:
    b = below("eager", cpu_blocks=2)
    ROOM_CONTROLS["busy-pool-is-miss"](b.planner)
    assert not waits_for_room(b)
    assert violations(b) == ["a lookup met a lower tier's hit with 2 CPU slots busy and answered a miss, though the "
                             "pool of 2 holds its 2 keys once their jobs end"]


def test_a_tier_hit_longer_than_the_cpu_pool_is_not_waited_for(below: Callable[..., Below]) -> None:
    b = below("eager", cpu_blocks=2)
    busy_pool(b)
    b.publish("near", [1, 2, 3])
    assert b.planner.fetch_missing([1, 2, 3], 0, step=0) == frozenset()
    assert b.planner.stats.room_waits == 0
    assert violations(b) == [], "a prefix the pool could never hold is no violation"


def test_the_planner_remembers_a_pools_worth_of_its_latest_lookups_that_found_no_room(
        below: Callable[..., Below]) -> None:
    b = below("eager", cpu_blocks=2)
    busy_pool(b)
    b.publish("near", [1, 2])
    for _ in range(3):
        b.planner.fetch_missing([1, 2], 0, step=0)
    assert len(b.planner.room_lookups) == 2

