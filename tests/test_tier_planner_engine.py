"""The scheduler half's tier planner inside an engine, rule by rule: what a cache reset does to write-backs in
flight, what the counters count when keys fail, how an abandoned job ends, which tier reports it refuses, and which
tier loaded tokens are credited to (one disk tier on a `SimDevice`, its I/O run when each test says). The planner
alone, over disk tiers of its own, is tested in `test_tier_planner.py`."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from kvfsm.connector.metadata import ConnectorOutput, TierOrder, TierReport, WorkerOutput
from kvfsm.connector.refusals import UnknownJob
from kvfsm.connector.tier_planner import TierPlanner
from kvfsm.connector.tier_runner import TierRunner, UnknownTier
from kvfsm.executor.sim import SimDevice
from kvfsm.tier_records import TierJob
from kvfsm.testing.harness import Harness
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
