"""The scheduler half's tier planner alone (no engine), over a real CPU pool and one or two disk tiers of its own
(`Below`), keys placed in the pool and the tiers by hand: lookup across tiers, the write-back byte bound and which
blocks are written back. The planner inside an engine is tested in `test_tier_planner_engine.py`."""

from __future__ import annotations

import errno
from itertools import count
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from kvfsm.bindings import default_spec
from kvfsm.config import DiskTierConfig, OffloadConfig, WriteBack
from kvfsm.connector.ledger import Ledger
from kvfsm.connector.tier_planner import TierPlanner
from kvfsm.connector.tier_runner import TierRunner
from kvfsm.executor.pool import HostPool
from kvfsm.executor.sim import SimDevice
from kvfsm.machines import MachineSet
from kvfsm.manager import OffloadingManager
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.io import ManualIo


# --- the planner alone, over disk tiers of its own: keys placed in the CPU pool and the tiers by hand ------------

BLOCK = 64


class Below:
    """A tier planner over a CPU pool and disk tiers opened here (no engine). Tests place keys in the pool
    (`ready`) and the tiers (`publish`), then run steps: `orders` submits the step's orders to the tiers through a
    `TierRunner`, as a worker does, and `land` runs their I/O and reports what ended."""

    def __init__(self, path: Path, writebacks: Sequence[WriteBack], cpu_blocks: int, bound_blocks: int,
                 queue_blocks: int | None = None) -> None:
        names = ("near", "far")[:len(writebacks)]
        config = OffloadConfig(cpu_blocks=cpu_blocks, writeback_max_bytes_in_flight=bound_blocks * BLOCK,
                               lower_tiers=tuple(DiskTierConfig(name=name, path=path, capacity_bytes=4 * BLOCK,
                                                                writeback=policy, evict_lookahead_blocks=2,
                                                                writeback_max_queued_blocks=queue_blocks)
                                                 for name, policy in zip(names, writebacks)))
        machines = MachineSet(default_spec())
        self.io = ManualIo()
        self.tiers = {name: DiskTier(name, path, 4 * BLOCK, BLOCK, self.io, machines=machines) for name in names}
        self.manager = OffloadingManager(cpu_blocks, "lru", machines, events=False)
        self.planner = TierPlanner(config, tuple(self.tiers.values()), self.manager, BLOCK, count(100).__next__,
                                   Ledger(machines, self.manager))
        self.runner = TierRunner(tuple(self.tiers.values()), HostPool(SimDevice(), cpu_blocks, BLOCK))
        self._jobs = count(1000)

    def ready(self, keys: Sequence[int]) -> None:
        """Store `keys` into the CPU pool, ready."""
        plan = self.manager.prepare_store(keys, next(self._jobs))
        assert plan is not None
        self.manager.mark_submitted(plan.slots)
        self.manager.complete_store(plan.slots, True)

    def publish(self, tier: str, keys: Sequence[int]) -> None:
        self.tiers[tier].submit_write(next(self._jobs), keys, [memoryview(bytes(BLOCK)) for _ in keys])
        self.io.run_all()
        assert all(done.ok for done in self.tiers[tier].poll())

    def orders(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """This step's orders (kind, tier, keys), submitted to the tiers."""
        orders = self.planner.orders(step=0)
        self.runner.submit(orders)
        return [(o.kind, o.tier, o.keys) for o in orders]

    def land(self) -> None:
        self.io.run_all()
        for report in self.runner.poll():
            self.planner.report(0, report, step=0)

    def close(self) -> None:
        self.runner.close()


@pytest.fixture
def below(tmp_path: Path) -> Iterator[Callable[..., Below]]:
    opened: list[Below] = []

    def open_(*writebacks: WriteBack, cpu_blocks: int = 4, bound_blocks: int = 4,
              queue_blocks: int | None = None) -> Below:
        opened.append(Below(tmp_path, writebacks, cpu_blocks, bound_blocks, queue_blocks))
        return opened[-1]

    yield open_
    for each in opened:
        each.close()


# lookup across tiers (eager tiers: nothing is written back that was not stored)


def test_a_prefix_only_the_second_tier_holds_is_fetched_from_it(below: Callable[..., Below]) -> None:
    b = below("eager", "eager")
    b.publish("far", [1, 2])
    deferred = b.planner.fetch_missing([1, 2], 0, step=0)
    orders = b.planner.orders(0)
    assert [(o.tier, o.keys) for o in orders] == [("far", (1, 2))]
    assert deferred == {orders[0].job_id}


def test_a_prefix_the_first_tier_holds_whole_is_fetched_from_it_alone(below: Callable[..., Below]) -> None:
    b = below("eager", "eager")
    b.publish("near", [1, 2])
    b.publish("far", [1, 2])
    deferred = b.planner.fetch_missing([1, 2], 0, step=0)
    orders = b.planner.orders(0)
    assert [(o.tier, o.keys) for o in orders] == [("near", (1, 2))]
    assert deferred == {orders[0].job_id}


def test_a_prefix_split_across_two_tiers_is_fetched_from_each_the_second_going_on_where_the_first_stopped(
        below: Callable[..., Below]) -> None:
    b = below("eager", "eager")
    b.ready([1])  # the CPU hit
    b.publish("near", [2])
    b.publish("far", [3])
    deferred = b.planner.fetch_missing([1, 2, 3], 1, step=0)
    orders = b.planner.orders(0)
    assert [(o.tier, o.keys) for o in orders] == [("near", (2,)), ("far", (3,))]
    assert deferred == {o.job_id for o in orders} and len(deferred) == 2, "the request does not defer on both"


def test_a_fetch_the_cpu_pool_has_no_room_for_is_not_ordered_and_the_request_defers_on_the_earlier_ones(
        below: Callable[..., Below]) -> None:
    b = below("eager", "eager", cpu_blocks=2)
    assert b.manager.prepare_store([9], 1) is not None  # the pool's other slot: a store in flight, not evictable
    b.publish("near", [1])
    b.publish("far", [2])
    deferred = b.planner.fetch_missing([1, 2], 0, step=0)
    orders = b.planner.orders(0)
    assert [(o.tier, o.keys) for o in orders] == [("near", (1,))]
    assert deferred == {orders[0].job_id, 1}, "nor on the store whose end makes room (fetch-waits-for-room)"


# write-back


def test_in_one_plan_each_tier_holding_candidates_back_at_the_byte_bound_counts(below: Callable[..., Below]) -> None:
    """One block's bytes in flight at most: near writes 1 back and holds 2; far, with 1 pinned, holds 2 too."""
    b = below("eager", "eager", bound_blocks=1)
    b.ready([1, 2])
    b.planner.stored([1, 2])
    assert b.orders() == [("write-back", "near", (1,))]
    assert b.planner.stats.writebacks_held == 2


def test_an_on_evict_tier_writes_its_next_victims_back_the_next_step_while_the_byte_bound_has_room(
        below: Callable[..., Below]) -> None:
    """A plan that ordered something does not stand: the next step plans again, even before the tier saw the first
    write-back (an engine that schedules ahead), and the bound's room left takes the next victims."""
    b = below("on-evict", bound_blocks=3)
    b.ready([1, 2, 3, 4])
    first, second = b.planner.orders(0), b.planner.orders(1)
    assert [o.keys for o in first] == [(4, 3)], "the eviction policy's next two victims"
    assert [o.keys for o in second] == [(2,)]


def test_a_write_back_candidate_waits_while_write_backs_in_flight_fill_the_byte_bound(
        below: Callable[..., Below]) -> None:
    b = below("eager", bound_blocks=1)
    b.ready([1, 2])
    b.planner.stored([1, 2])
    assert b.orders() == [("write-back", "near", (1,))]
    assert b.orders() == [], "a second write-back was ordered beyond the bound"
    b.land()
    assert b.orders() == [("write-back", "near", (2,))]


def test_each_plan_in_which_a_write_back_candidate_waits_for_the_bound_counts_once(
        below: Callable[..., Below]) -> None:
    b = below("eager", bound_blocks=1)
    b.ready([1, 2])
    b.planner.stored([1, 2])
    b.orders()
    b.orders()
    assert b.planner.stats.writebacks_held == 2


def test_write_backs_to_several_tiers_share_one_byte_bound(below: Callable[..., Below]) -> None:
    """A block is pinned for one write-back at a time: the far tier's candidates are those the near one left."""
    b = below("eager", "eager", bound_blocks=3)
    b.ready([1, 2, 3, 4])
    b.publish("near", [2, 3, 4])
    b.planner.stored([1, 2, 3, 4])
    assert b.orders() == [("write-back", "near", (1,)), ("write-back", "far", (2, 3))]


def test_a_tier_that_holds_every_candidate_does_not_stop_the_next_tiers_write_backs(
        below: Callable[..., Below]) -> None:
    b = below("eager", "eager")
    b.ready([1])
    b.publish("near", [1])
    b.planner.stored([1])
    assert b.orders() == [("write-back", "far", (1,))]


def test_a_key_its_tier_is_still_writing_is_not_ordered_written_again(below: Callable[..., Below]) -> None:
    """After a cache reset the key is stored again while the write-back from before the reset still runs."""
    b = below("eager")
    b.ready([1])
    b.planner.stored([1])
    assert b.orders() == [("write-back", "near", (1,))]
    b.manager.reset()
    b.planner.reset()
    b.ready([1])
    b.planner.stored([1])
    assert b.orders() == []


def test_an_eager_write_back_passes_over_a_block_evicted_before_its_turn(below: Callable[..., Below]) -> None:
    b = below("eager")
    b.ready([2])
    b.planner.stored([1, 2])  # 1 is no longer in the pool
    assert b.orders() == [("write-back", "near", (2,))]


def test_a_block_loading_when_its_eager_write_back_comes_up_is_written_back_once_the_load_ended(
        below: Callable[..., Below]) -> None:
    b = below("eager")
    b.ready([1])
    slots = b.manager.prepare_load([1])
    b.planner.stored([1])
    assert b.orders() == []
    b.manager.complete_load(slots)
    assert b.orders() == [("write-back", "near", (1,))]


def test_on_evict_writes_back_the_one_ready_block_when_fewer_than_its_lookahead_are_ready(
        below: Callable[..., Below]) -> None:
    b = below("on-evict")
    b.ready([1])
    assert b.orders() == [("write-back", "near", (1,))]


def test_on_evict_does_not_write_back_again_a_block_its_tier_holds(below: Callable[..., Below]) -> None:
    b = below("on-evict")
    b.ready([1])
    assert b.orders() == [("write-back", "near", (1,))]
    b.land()
    assert b.orders() == []


def fail_writes(b: Below) -> None:
    """Every write queued at the tiers fails with an I/O error; every job that ended is reported."""
    for future, _ in b.io.queue:
        future.set_exception(OSError(errno.EIO, "injected"))
    b.io.queue.clear()
    b.io.numbers.clear()
    b.land()


def test_with_two_tiers_a_key_whose_write_back_failed_to_each_is_tried_on_neither_again(
        below: Callable[..., Below]) -> None:
    """A pool's worth of keys given up on is remembered per tier: with a one-block pool and two tiers, both."""
    b = below("on-evict", "on-evict", cpu_blocks=1)
    b.ready([1])
    assert b.orders() == [("write-back", "near", (1,))]
    fail_writes(b)
    assert b.orders() == [("write-back", "far", (1,))]
    fail_writes(b)
    assert b.orders() == []


def test_the_running_totals_name_every_tier_and_reason_from_the_start_and_count_what_moved(
        below: Callable[..., Below]) -> None:
    b = below("eager", "eager")
    totals = b.planner.totals()
    assert set(totals.values()) == {0}
    assert {"tier.blocks.write-back.near", "tier.bytes.fetch.far", "tier.failures.timeout"} <= set(totals)
    b.ready([1, 2])
    b.planner.stored([1, 2])
    for _ in range(2):  # near's write-back, then far's (a block is pinned by one write-back at a time)
        b.orders()
        b.land()
    totals = b.planner.totals()
    assert (totals["tier.blocks.write-back.near"], totals["tier.bytes.write-back.far"]) == (2, 2 * BLOCK)

