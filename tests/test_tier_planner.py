"""The scheduler half's tier planner, rule by rule: what a cache reset does to write-backs in flight, what the
counters count when keys fail, how an abandoned job ends, which tier reports it refuses, and which tier loaded
tokens are credited to (one disk tier on a `SimDevice`, its I/O run when each test says); then the planner alone
over two disk tiers (`Below`): lookup across tiers, the write-back byte bound and which blocks are written back."""

from __future__ import annotations

from itertools import count
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from kvfsm.bindings import default_spec
from kvfsm.config import DiskTierConfig, OffloadConfig, WriteBack
from kvfsm.connector.ledger import Ledger
from kvfsm.connector.metadata import ConnectorOutput, TierOrder, TierReport, WorkerOutput
from kvfsm.connector.tier_planner import TierPlanner
from kvfsm.connector.tier_runner import TierRunner, UnknownTier
from kvfsm.connector.validation import UnknownJob
from kvfsm.executor.pool import HostPool
from kvfsm.executor.sim import SimDevice
from kvfsm.machines import MachineSet
from kvfsm.manager import OffloadingManager
from kvfsm.records import TierJob
from kvfsm.testing.harness import Harness
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.io import ManualIo
from test_tiers_disk import B, _serve

A = (11, 12, 13, 14)
C = (31, 32, 33, 34)


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    """Opens engines on a `SimDevice` (`Harness` options), each closed (disk directory removed) after the test."""
    opened: list[Harness] = []

    def open_(**options: object) -> Harness:
        opened.append(Harness(SimDevice(), **options))  # type: ignore[arg-type]
        return opened[-1]

    yield open_
    for each in opened:
        each.close()


@pytest.fixture
def h(harness: Callable[..., Harness]) -> Harness:
    """An engine with a one-disk tier below a two-block CPU pool."""
    return harness(num_gpu_blocks=8, cpu_blocks=2, disk_slots=4)


def planner(h: Harness) -> TierPlanner:
    tiers = h.connector.scheduler.tiers
    assert tiers is not None
    return tiers


def tier_jobs(h: Harness) -> dict[int, TierJob]:
    return h.connector.scheduler.tier_jobs


def write_back_in_flight(h: Harness) -> tuple[int, ...]:
    """Serve a prompt, the device settling but the disk's I/O held, until its write-back is ordered and submitted;
    the keys it writes."""
    h.add_request(A + (1,), 1)
    for _ in range(10):
        h.engine.step()
        h.device.run_until_idle()
        jobs = [j for j in tier_jobs(h).values() if j.kind == "write-back" and j.in_flight]
        if jobs and h.io.queue:
            return jobs[0].keys
    raise AssertionError("no write-back was submitted")


def test_a_write_back_in_flight_at_a_cache_reset_publishes_nothing_when_it_lands(h: Harness) -> None:
    keys = write_back_in_flight(h)
    h.connector.reset_cache()
    h.drain()  # the write lands, the tier polls it done, the planner hears of it
    assert h.disk is not None and h.disk.lookup(keys) == 0, "a write-back from before the reset was published"
    assert h.final_violations() == []


def test_a_write_back_that_fails_counts_only_the_blocks_it_wrote(h: Harness) -> None:
    h.tier_faults.inject("disk-full")
    keys = write_back_in_flight(h)
    h.drain()
    stats = planner(h).stats
    failed = sum(stats.failures.values())
    assert failed > 0, "the disk-full fault failed no key"
    assert stats.blocks_written_back["disk"] == len(keys) - failed
    assert h.final_violations() == []


def test_a_write_back_abandoned_at_its_deadline_frees_its_slots_once_its_write_returns(h: Harness) -> None:
    h.connector.scheduler.ledger.keep_history = False  # as in production: a released job is forgotten
    write_back_in_flight(h)
    h.tier_faults.inject("stall")  # the disk hangs past the write's deadline
    h.engine.step()
    assert planner(h).stats.failures, "the write-back was not abandoned"
    h.drain()  # the write returns: the job is released, its slots freed
    usage = h.connector.scheduler.manager.usage()
    assert usage.get("writing-back", 0) == 0 and usage.get("orphaned", 0) == 0
    assert tier_jobs(h) == {} and planner(h).idle
    assert h.final_violations() == []


def refusal(h: Harness, *reports: TierReport) -> str:
    """What refuses these reports of worker 0, all in one output; nothing of the output was applied."""
    before = {job_id: (job.state, dict(job.reports)) for job_id, job in tier_jobs(h).items()}
    with pytest.raises(UnknownJob) as refused:
        h.connector.scheduler.update_connector_output(ConnectorOutput(workers=(WorkerOutput(tiers=reports),)))
    assert {job_id: (job.state, dict(job.reports)) for job_id, job in tier_jobs(h).items()} == before
    return str(refused.value).removeprefix("update_connector_output: ").split(";")[0]


def test_a_report_of_a_tier_job_not_in_flight_is_refused_naming_worker_and_job(h: Harness) -> None:
    assert refusal(h, TierReport(job_id=999)) == "worker 0 reported tier job 999, which is not in flight for it"
    write_back_in_flight(h)
    h.drain()
    done = max(tier_jobs(h))
    assert refusal(h, TierReport(job_id=done)) == f"worker 0 reported tier job {done}, which is not in flight for it"


def test_a_tier_job_reported_twice_in_one_output_is_refused_and_neither_report_applied(h: Harness) -> None:
    write_back_in_flight(h)
    job = max(tier_jobs(h))
    assert refusal(h, TierReport(job_id=job), TierReport(job_id=job)) == \
        f"worker 0 reported tier job {job}, which is not in flight for it"
    h.drain()
    assert h.final_violations() == []


def test_a_release_of_a_tier_job_the_worker_does_not_hold_is_refused_naming_worker_and_job(h: Harness) -> None:
    write_back_in_flight(h)
    job = max(tier_jobs(h))
    assert refusal(h, TierReport(job_id=job, release=True)) == \
        f"worker 0 released tier job {job}, which it does not hold"
    assert refusal(h, TierReport(job_id=999, release=True)) == \
        "worker 0 released tier job 999, which it does not hold"
    assert refusal(h, TierReport(job_id=job, held=True), TierReport(job_id=job, release=True),
                   TierReport(job_id=job, release=True)) == f"worker 0 released tier job {job}, which it does not hold"
    h.drain()
    assert h.final_violations() == []


def test_a_tier_job_reported_held_and_released_in_one_output_frees_its_slots(h: Harness) -> None:
    write_back_in_flight(h)
    job = tier_jobs(h)[max(tier_jobs(h))]
    h.connector.scheduler.update_connector_output(ConnectorOutput(workers=(WorkerOutput(tiers=(
        TierReport(job_id=job.job_id, held=True), TierReport(job_id=job.job_id, release=True))),)))
    assert job.state == "failed"
    assert [h.connector.scheduler.manager.blocks[s].state for s in job.cpu_slots] == ["free"] * len(job.cpu_slots)


def test_a_tier_job_that_ended_blocks_no_cpu_slot(h: Harness) -> None:
    """A request that meets one of its slots busy later must not wait for a job that is over."""
    write_back_in_flight(h)
    job = next(j for j in tier_jobs(h).values() if j.in_flight)
    ledger = h.connector.scheduler.ledger
    assert ledger.tier_blockers(job.cpu_slots) == {job.job_id}
    h.drain()
    assert ledger.tier_blockers(job.cpu_slots) == set()


def test_an_order_for_a_tier_the_worker_did_not_open_is_refused_naming_it(h: Harness) -> None:
    assert h.disk is not None
    runner = TierRunner((h.disk,), h.connector.worker.pool)
    order = TierOrder(job_id=7, kind="fetch", tier="tape", keys=(1,), cpu_slots=(0,))
    with pytest.raises(UnknownTier) as refused:
        runner.submit([order])
    assert refused.value.args[0] == "tier order 7 names tier 'tape'; open: ['disk']"


# --- where loaded tokens came from, and a fetch abandoned after a reset -----------------------------------------

@pytest.mark.parametrize(("fault", "credited"), [("corrupt-block", 2), ("stall", 0)])
def test_a_tier_is_credited_only_with_the_tokens_of_blocks_its_fetches_brought(
        harness: Callable[..., Harness], fault: str, credited: int) -> None:
    """A fetch of A fails for its first block (corrupt) or whole (abandoned at its deadline); the request computes
    what it lacked and stores it. Loaded later from the CPU pool, the blocks it computed came from no tier."""
    h = harness(num_gpu_blocks=8, cpu_blocks=4, disk_slots=6)
    for prompt in (A + (1,), B + (2,), C + (3,)):  # A pushed out of the CPU pool, kept on disk
        _serve(h, prompt)
    h.engine.reset_prefix_cache()
    if fault == "corrupt-block":
        h.tier_faults.inject(fault)
    h.add_request(A + (4,), 1)
    h.engine.step()  # the fetch is ordered and its read submitted
    if fault == "stall":
        h.tier_faults.inject(fault)
    h.drain()
    _serve(h, A + (5,))
    assert planner(h).stats.tokens_loaded_from["disk"] == credited
    assert h.final_violations() == []


def on_disk_only(harness: Callable[..., Harness], prompt: tuple[int, ...]) -> Harness:
    """An engine with two GPU blocks (4 tokens) per CPU block whose disk tier holds `prompt`'s CPU blocks, its
    three-block CPU pool and its GPU prefix cache holding none of them."""
    h = harness(num_gpu_blocks=16, cpu_blocks=3, block_size_factor=2, disk_slots=8)
    _serve(h, prompt + (1,))
    _serve(h, tuple(range(41, 53)) + (2,))  # three CPU blocks: the prompt's are pushed out of the CPU pool
    h.engine.reset_prefix_cache()
    return h


def test_a_tier_is_credited_with_every_token_of_the_cpu_blocks_a_load_takes_whole(
        harness: Callable[..., Harness]) -> None:
    """Two GPU blocks (4 tokens) per CPU block: A and B, fetched from disk, are loaded whole: 8 tokens."""
    h = on_disk_only(harness, A + B)
    _serve(h, A + B + (3,))
    assert planner(h).stats.tokens_loaded_from["disk"] == 8
    assert h.final_violations() == []


def test_a_load_that_starts_mid_cpu_block_credits_its_tier_only_with_the_tokens_it_takes(
        harness: Callable[..., Harness]) -> None:
    """The GPU prefix cache holds A and half of B (3 GPU blocks); the load takes B's other half and C from disk:
    2 + 4 tokens, not the whole of B nor the blocks the GPU prefix covered."""
    h = on_disk_only(harness, A + B + C)
    _serve(h, A + B[:2] + (3,))  # loads A from disk (4 tokens), computes the rest
    assert planner(h).stats.tokens_loaded_from["disk"] == 4
    h.add_request(A + B + C + (4,), 1)
    h.drain()
    assert planner(h).stats.tokens_loaded_from["disk"] == 4 + 6
    assert h.final_violations() == []


def test_a_fetch_abandoned_after_a_cache_reset_frees_its_slots_once_its_read_returns(h: Harness) -> None:
    _serve(h, A + (1,))
    _serve(h, B + (2,))  # A now only on disk
    h.engine.reset_prefix_cache()
    h.add_request(A + (3,), 1)
    h.engine.step()  # the fetch is ordered and its read submitted
    h.connector.reset_cache()
    h.tier_faults.inject("stall")
    h.engine.step()  # the read is past its deadline: the fetch is abandoned
    assert planner(h).stats.failures == {"timeout": 2}
    h.drain()
    assert h.connector.scheduler.manager.usage()["orphaned"] == 0
    assert h.final_violations() == []


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

