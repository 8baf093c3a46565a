"""Replicated (MLA) KV with a lower tier and checksums (spec: `replicated-one-tier-move`): two ranks on SimDevices
share one host pool; rank 0 alone opens the disk tier and moves every write-back and fetch between it and the
shared slots, rank 1 reports each tier job at once having moved nothing, and every job still ends on both ranks'
reports (`tier-job-every-rank`). A block's checksum is taken by the rank that copied it into a table the ranks
share, and every rank checks its own load against it."""

from __future__ import annotations

import os

import pytest
import torch

from kvfsm.executor.pool import HostPool
from kvfsm.executor.shared_host import TABLE_SUFFIX, SharedHostMemory
from kvfsm.executor.sim import SimDevice
from kvfsm.states import TierJobState
from kvfsm.testing.harness import TP_SHAPE, Harness
from kvfsm.testing.tier_mutants import REPLICATED_TIER_CONTROLS, TIER_RANK_CONTROLS

PROMPTS = [tuple(range(10 * i + 1, 10 * i + 5)) for i in range(3)]
"""Two CPU blocks each: the CPU pool (two slots) holds one prompt, so the next pushes the first out to the disk."""


def replicated_with_disk(checksum: bool = True) -> Harness:
    return Harness([SimDevice(), SimDevice()], num_gpu_blocks=8, cpu_blocks=2, disk_slots=6, shape=TP_SHAPE,
                   replicated=True, checksum=checksum)


def push_out_then_reload(harness: Harness) -> None:
    """Serve each prompt (the later ones push the first out of the CPU pool, after its eager write-back), then the
    first again: it is fetched from the disk into the shared slots and loaded by both ranks."""
    for prompt in [*PROMPTS, PROMPTS[0]]:
        harness.engine.reset_prefix_cache()
        harness.add_request(prompt + (0,), 1)
        harness.drain()


def test_replicated_kv_is_written_back_once_and_fetched_into_the_shared_copy_once_and_reloads_byte_exact() -> None:
    harness = replicated_with_disk()
    try:
        push_out_then_reload(harness)
        assert not (found := harness.final_violations()), "\n".join(found)  # replicated-one-tier-move among them
        stats = harness.connector.scheduler.tiers.stats  # type: ignore[union-attr]
        assert stats.tokens_loaded_from["disk"] > 0, "nothing was fetched from the disk and loaded"
        assert [len(worker.lower_tiers) for worker in harness.connector.workers] == [1, 0], "rank 1 opened a tier"
        jobs = harness.world.tier_jobs.values()
        assert {job.kind for job in jobs} == {"write-back", "fetch"}
        assert all({rank: report.moved for rank, report in job.reports.items()} == {0: True, 1: False}
                   for job in jobs), "a tier job was not reported by both ranks, moved by rank 0 alone"
        assert all(all(load.values()) for load in load_reports(harness)), "a rank's load failed its checksum"
    finally:
        harness.close()


@pytest.mark.parametrize("fault", ["read-io-error", "corrupt-block"])
def test_a_fetch_the_mover_failed_fails_everywhere_though_the_other_rank_reported_it_moved_nothing(fault: str) -> None:
    """Rank 1's empty report of the fetch succeeds; rank 0's read fails: the fetch fails, its shared slots are
    freed and the request recomputes (the tokens stay right)."""
    harness = replicated_with_disk()
    try:
        for prompt in PROMPTS:
            harness.engine.reset_prefix_cache()
            harness.add_request(prompt + (0,), 1)
            harness.drain()
        harness.tier_faults.inject(fault)
        harness.engine.reset_prefix_cache()
        harness.add_request(PROMPTS[0] + (0,), 1)
        harness.drain()
        fetches = [job for job in harness.world.tier_jobs.values() if job.kind == "fetch"]
        assert [job.state for job in fetches] == [TierJobState.FAILED], "the fetch did not fail"
        assert {rank: bool(report.failed) for rank, report in fetches[0].reports.items()} == {0: True, 1: False}
        assert not (found := harness.final_violations()), "\n".join(found)
    finally:
        harness.close()


def test_control_every_rank_moves_is_caught_by_replicated_one_tier_move() -> None:
    harness = replicated_with_disk()
    try:
        REPLICATED_TIER_CONTROLS["every-rank-moves"](harness.engine, harness.connector)
        push_out_then_reload(harness)
        found = harness.final_violations()
        assert any(line.startswith("replicated-one-tier-move") and "ranks [0, 1]" in line for line in found), found
    finally:
        harness.close()


def test_with_replicated_kv_a_tier_job_ended_on_its_first_report_is_caught_with_no_failing_rank() -> None:
    """Rank 1 reports each tier job in the step it is ordered, before rank 0's disk I/O ran: a scheduler half ending
    the job on that report ends a fetch whose read has not landed in the shared slot."""
    harness = replicated_with_disk(checksum=False)
    try:
        TIER_RANK_CONTROLS["tier-first-report"](harness.connector.scheduler.tiers)  # type: ignore[arg-type]
        found = first_violations(harness)
        assert any(line.startswith("tier-job-every-rank") for line in found), found
    finally:
        harness.close()


def first_violations(harness: Harness) -> list[str]:
    """`push_out_then_reload`, step by step, up to the first step after which something is wrong (rank 0's late
    report of a job already ended would then be refused by the scheduler half)."""
    for prompt in [*PROMPTS, PROMPTS[0]]:
        harness.engine.reset_prefix_cache()
        harness.add_request(prompt + (0,), 1)
        while harness.engine.has_work:
            harness.engine.step()
            harness.settle()
            if found := harness.violations():
                return found
    return []


def test_every_rank_checks_its_load_of_a_shared_slot_against_the_checksum_its_writer_took() -> None:
    """Both ranks load a shared slot cleanly (the rank that did not write it finds the writer's checksum); once the
    slot changed, both ranks' loads of it fail (the engine recomputes, the tokens stay right)."""
    harness = Harness([SimDevice(), SimDevice()], num_gpu_blocks=8, cpu_blocks=6, shape=TP_SHAPE, replicated=True,
                      checksum=True)
    try:
        for _ in range(2):
            harness.engine.reset_prefix_cache()
            harness.add_request(PROMPTS[0] + (0,), 1)
            harness.drain()
        assert load_reports(harness) == [{0: True, 1: True}], "a rank's load of the shared slot failed its check"
        for slot in harness.connector.scheduler.manager.catalogue.values():
            harness.connector.workers[0].pool.slot(slot)[0] ^= 0xFF
        harness.engine.reset_prefix_cache()
        harness.add_request(PROMPTS[0] + (0,), 1)
        harness.drain()
        assert load_reports(harness)[1:] == [{0: False, 1: False}], "a rank loaded a slot changed since its store"
        assert not any(line.startswith("output") for line in harness.final_violations())
    finally:
        harness.close()


def load_reports(harness: Harness) -> list[dict[int, bool]]:
    """Each load job's reports by rank (succeeded or not), in order."""
    return [dict(job.reports) for job in harness.world.jobs.values() if job.kind == "load"]


def test_the_shared_checksum_table_is_one_memory_for_every_rank_and_leaves_with_the_region() -> None:
    creator = SharedHostMemory()
    first = HostPool(SimDevice(), 4, 64, creator)
    first_table = creator.table(4)
    assert creator.path is not None and bool((first_table == 0).all()), "a fresh table holds a checksum"
    attached = SharedHostMemory(creator.path)
    second = HostPool(SimDevice(), 4, 64, attached)
    attached.table(4)[2] = 7
    assert int(first_table[2]) == 7, "the ranks' tables are not one memory"
    second.close()
    first.close()
    assert not os.path.exists(creator.path + TABLE_SUFFIX)


def test_two_ranks_in_one_process_share_one_anonymous_table() -> None:
    shared = SharedHostMemory(named=False)
    pools = [HostPool(SimDevice(), 2, 8, shared) for _ in range(2)]
    shared.table(2)[1] = 5
    assert torch.equal(shared.table(2), torch.tensor([0, 5]))
    for pool in pools:
        pool.close()
