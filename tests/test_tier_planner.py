"""The scheduler half's tier planner, rule by rule: what a cache reset does to write-backs in flight, what the
counters count when keys fail, how an abandoned write-back ends, and which tier reports it refuses (one disk tier
on a `SimDevice`, its I/O run when each test says)."""

from __future__ import annotations

from typing import Iterator

import pytest

from kvfsm.connector.metadata import TierReport
from kvfsm.connector.tier_planner import TierPlanner
from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import Harness

A = (11, 12, 13, 14)


@pytest.fixture
def h() -> Iterator[Harness]:
    """An engine with a one-disk tier below a two-block CPU pool, closed (disk directory removed) after the test."""
    harness = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4)
    yield harness
    harness.close()


def planner(h: Harness) -> TierPlanner:
    tiers = h.connector.scheduler.tiers
    assert tiers is not None
    return tiers


def write_back_in_flight(h: Harness) -> tuple[int, ...]:
    """Serve a prompt, the device settling but the disk's I/O held, until its write-back is ordered and submitted;
    the keys it writes."""
    h.add_request(A + (1,), 1)
    for _ in range(10):
        h.engine.step()
        h.device.run_until_idle()
        jobs = [j for j in planner(h).jobs.values() if j.kind == "write-back" and j.in_flight]
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
    planner(h).keep_history = False  # as in production: a released job is forgotten
    write_back_in_flight(h)
    h.tier_faults.inject("stall")  # the disk hangs past the write's deadline
    h.engine.step()
    assert planner(h).stats.failures, "the write-back was not abandoned"
    h.drain()  # the write returns: the job is released, its slots freed
    usage = h.connector.scheduler.manager.usage()
    assert usage.get("writing-back", 0) == 0 and usage.get("orphaned", 0) == 0
    assert planner(h).jobs == {} and planner(h).idle
    assert h.final_violations() == []


def refusal(h: Harness, worker: int, report: TierReport) -> str:
    with pytest.raises(KeyError) as refused:
        planner(h).report(worker, report, step=0)
    return str(refused.value.args[0])


def test_a_report_of_a_tier_job_not_in_flight_is_refused_naming_worker_and_job(h: Harness) -> None:
    assert refusal(h, 0, TierReport(job_id=999)) == \
        "worker 0 reported tier job 999, which is not in flight for it"
    write_back_in_flight(h)
    h.drain()
    done = max(planner(h).jobs)
    assert refusal(h, 0, TierReport(job_id=done)) == \
        f"worker 0 reported tier job {done}, which is not in flight for it"


def test_a_release_of_a_tier_job_the_worker_does_not_hold_is_refused_naming_worker_and_job(h: Harness) -> None:
    write_back_in_flight(h)
    job = max(planner(h).jobs)
    assert refusal(h, 0, TierReport(job_id=job, release=True)) == \
        f"worker 0 released tier job {job}, which it does not hold"
    assert refusal(h, 0, TierReport(job_id=999, release=True)) == \
        "worker 0 released tier job 999, which it does not hold"
    h.drain()
    assert h.final_violations() == []
