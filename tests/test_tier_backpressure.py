"""The tier planner's back-pressure (spec: tier-job's `writeback-queue-bounded` and its `created -> shed` edge): an
eager tier's queue of stored blocks waiting for their write-back holds at most `writeback_max_queued_blocks`; the
blocks a completed store brings beyond it are shed for that tier, written nowhere, and counted under its name.

The planner alone, over disk tiers of its own (`test_tier_planner.Below`): keys placed in the CPU pool by hand, the
tiers' I/O run when the test says, so a tier that falls behind is one whose I/O the test does not run.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

from kvfsm.invariants import check_all
from kvfsm.states import TierJobState
from kvfsm.testing.mutants import queue_bound_per_batch
from test_tier_planner import Below, below  # noqa: F401 (the fixture)


def queued(b: Below) -> dict[str, tuple[int, int | None]]:
    return b.planner.queues()


def watch_sheds(b: Below) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """The (tier, keys, CPU slots) of each write-back the tier-job machine moves created -> shed from now on (the
    planner's ledger keeps no ended job: this is where a shed shows)."""
    seen: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    b.planner.ledger._tier_job.observers.append(
        lambda lifecycle, job, source, trigger, dest: seen.append((job.tier, job.keys, job.cpu_slots))
        if (source, trigger, dest) == (TierJobState.CREATED, "shed", TierJobState.SHED) else None)
    return seen


def test_without_a_bound_a_tier_that_falls_behind_queues_every_stored_block(below: Callable[..., Below]) -> None:
    """What the bound is for: nothing ends while the tier's write-backs fill the byte bound, and the queue grows."""
    b = below("eager", bound_blocks=1)
    b.ready([1, 2, 3, 4])
    b.planner.stored([1, 2])
    b.orders()  # 1 is written back; 2 waits for the byte bound
    b.planner.stored([3, 4])
    assert queued(b) == {"near": (3, None)}


def test_blocks_beyond_the_queue_bound_are_shed_for_that_tier(below: Callable[..., Below]) -> None:
    b = below("eager", bound_blocks=1, queue_blocks=2)
    sheds = watch_sheds(b)
    b.ready([1, 2, 3, 4])
    b.planner.stored([1, 2])
    b.orders()
    b.planner.stored([3, 4])
    assert queued(b) == {"near": (2, 2)}
    assert sheds == [("near", (4,), ())]
    assert b.planner.connector_stats.store_shed == {"near": 1}


def test_a_shed_block_is_never_written_back_to_that_tier(below: Callable[..., Below]) -> None:
    b = below("eager", bound_blocks=4, queue_blocks=1)
    b.ready([1, 2])
    b.planner.stored([1, 2])
    ordered = b.orders()
    b.land()
    assert ordered == [("write-back", "near", (1,))] and b.orders() == []
    assert b.tiers["near"].lookup([1, 2]) == 1


def test_each_eager_tier_sheds_by_its_own_queue(below: Callable[..., Below]) -> None:
    """One tier's full queue sheds for that tier only: the other is still offered every block."""
    b = below("eager", "eager", bound_blocks=4, queue_blocks=1)
    sheds = watch_sheds(b)
    b.ready([1, 2])
    b.planner.stored([1, 2])
    assert sorted(sheds) == [("far", (2,), ()), ("near", (2,), ())]


def test_a_shed_write_back_is_never_ordered_and_holds_no_slot(below: Callable[..., Below]) -> None:
    b = below("eager", bound_blocks=4, queue_blocks=1)
    b.ready([1, 2])
    b.planner.stored([1, 2])
    orders = b.orders()
    assert [keys for _, _, keys in orders] == [(1,)]
    assert b.manager.usage()["writing-back"] == 1 and b.planner.idle is False
    b.land()
    assert b.planner.idle


def _world(b: Below) -> SimpleNamespace:
    return SimpleNamespace(writeback_queues=b.planner.queues())


def test_control_a_queue_bound_per_batch_is_caught(below: Callable[..., Below]) -> None:
    """The bound held against each store's blocks alone: store after store, the queue outgrows it."""
    b = below("eager", bound_blocks=1, queue_blocks=2)
    scheduler = type("Scheduler", (), {"tiers": b.planner})()
    queue_bound_per_batch(scheduler)  # type: ignore[arg-type]
    b.ready([1, 2, 3, 4])
    b.planner.stored([1, 2])
    b.orders()
    b.planner.stored([3, 4])
    assert check_all(_world(b), ["writeback-queue-bounded"]) == {  # type: ignore[arg-type]
        "writeback-queue-bounded": ["near: 3 stored blocks wait for their write-back, bound 2"]}
