"""checksum with a lower tier: a block's checksum, taken when it was first stored, travels with it through the tier
and back, so a fetched block loads checked against its own bytes: not against the slot's previous occupant (a
false mismatch) and never unchecked."""

from __future__ import annotations

from kvfsm.engine.oracle import expected_tokens
from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import Harness

FIRST = (11, 12, 13, 14, 15, 16)
SECOND = (21, 22, 23, 24, 25, 26)


def through_the_disk(rot_after_fetch: bool = False) -> Harness:
    """FIRST is stored and written back to the disk, SECOND takes its CPU slots, then FIRST is served again: its
    blocks come back from the disk into slots SECOND's blocks held (with `rot_after_fetch`, a byte of each fetched
    slot flips between the fetch and the load)."""
    harness = Harness(SimDevice(), num_gpu_blocks=12, cpu_blocks=3, checksum=True, disk_slots=16,
                      writeback="eager", writeback_bound_blocks=8)
    if rot_after_fetch:
        rot_fetched_slots(harness)
    for prompt in (FIRST, SECOND):
        harness.add_request(prompt + (1,), 1)
        harness.drain()
        harness.engine.reset_prefix_cache()
    harness.add_request(FIRST + (2,), 2)
    harness.drain()
    return harness


def rot_fetched_slots(harness: Harness) -> None:
    """Each CPU slot a fetch filled gets one byte flipped as soon as the fetch is reported (host memory rot)."""
    worker = harness.connector.worker
    runner = worker._tiers
    poll = runner.poll

    def rotting() -> object:
        reports = poll()
        for report in reports:
            job = harness.connector.scheduler.ledger.tier_jobs[report.job_id]
            if job.kind == "fetch" and not report.failed and not report.held and not report.release:
                for slot in job.cpu_slots:
                    worker.pool.slot(slot)[0] ^= 0x40
        return reports

    runner.poll = rotting


def fetched_tokens(harness: Harness) -> int:
    return harness.connector.scheduler.tiers.stats.tokens_loaded_from["disk"]


def test_a_block_fetched_into_a_reused_slot_loads_checked_against_its_own_checksum() -> None:
    harness = through_the_disk()
    stats = harness.connector.scheduler.stats
    assert fetched_tokens(harness) > 0 and stats.loads_failed == 0, "a fetched block failed its checksum"
    assert harness.engine.outputs()[2] == list(expected_tokens(FIRST + (2,), 2, harness.shape))
    assert harness.final_violations() == []


def test_a_fetched_block_whose_slot_changed_before_its_load_fails_the_load() -> None:
    harness = through_the_disk(rot_after_fetch=True)
    assert harness.connector.scheduler.stats.loads_failed > 0, "a changed fetched block was loaded"
    assert harness.engine.outputs()[2] == list(expected_tokens(FIRST + (2,), 2, harness.shape))
