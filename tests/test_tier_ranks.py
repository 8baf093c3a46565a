"""A lower-tier job under tensor parallelism (spec: `tier-job-every-rank`): each rank moves its own heads' share of a
block through its own tier I/O, so one rank may fail a key that another rank's read of it brought back whole. The
job must then fail that key everywhere, whichever report the scheduler hears first, and end only once both ranks
reported: a fetch's CPU slot is freed (the request recomputes), never loadable with one rank's heads stale; a
write-back's block is not counted as written back (nor ordered again).

The scheduler's tier planner runs over two ranks' disk tiers (it looks up in rank 0's, as a scheduler process
does), each rank with its own CPU pool, tier runner and disk I/O, one of which fails its next read. The control
`tier-first-report` (a job ends on the first report) must be caught in both orders."""

from __future__ import annotations

import errno
from itertools import count
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from kvfsm.bindings import default_spec
from kvfsm.config import DiskTierConfig, OffloadConfig
from kvfsm.connector.ledger import Ledger
from kvfsm.connector.tier_planner import TierPlanner
from kvfsm.connector.tier_runner import TierRunner
from kvfsm.executor.pool import HostPool
from kvfsm.executor.sim import SimDevice
from kvfsm.invariants import check_all
from kvfsm.machines import MachineSet
from kvfsm.manager import OffloadingManager
from kvfsm.tier_records import TierJob
from kvfsm.states import CpuBlockState as Cpu
from kvfsm.states import TierJobState as Job
from kvfsm.testing.tier_faults import FaultyDiskIo
from kvfsm.testing.tier_mutants import TIER_RANK_CONTROLS
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.io import ManualIo

BLOCK = 64
RANKS = 2
KEY = 0x51
"""Published in both ranks' tiers: the key the fetches read."""
FRESH = 0x52
"""In the CPU pool only: the key the write-backs write."""
ORDERS = {"failure-first": lambda failing: [failing, 1 - failing],
          "success-first": lambda failing: [1 - failing, failing]}
"""Which rank's report of the fetch the scheduler hears first."""


class TwoRanks:
    """Two ranks' disk tiers under one scheduler's tier planner, each tier holding `KEY` (each rank's heads of it)."""

    def __init__(self, path: Path) -> None:
        config = OffloadConfig(cpu_blocks=4, num_workers=RANKS, lower_tiers=(DiskTierConfig(
            name="disk", path=path, capacity_bytes=4 * BLOCK, writeback="eager", evict_lookahead_blocks=2),))
        machines = MachineSet(default_spec())
        self.io = ManualIo()
        self.disk_io = [FaultyDiskIo() for _ in range(RANKS)]
        self.tiers = [DiskTier("disk", path, 4 * BLOCK, BLOCK, self.io, worker=rank, disk_io=self.disk_io[rank],
                               machines=machines) for rank in range(RANKS)]
        self.manager = OffloadingManager(4, "lru", machines, events=False)
        ledger = Ledger(machines, self.manager, keep_history=True)
        self.planner = TierPlanner(config, self.tiers[:1], self.manager, BLOCK, count(100).__next__, ledger)
        self.runners = [TierRunner((tier,), HostPool(SimDevice(), 4, BLOCK)) for tier in self.tiers]
        self.world = SimpleNamespace(tier_jobs=ledger.tier_jobs, num_workers=RANKS)
        for rank, tier in enumerate(self.tiers):
            tier.submit_write(rank, [KEY], [memoryview(bytes([rank + 1]) * BLOCK)])
        self.io.run_all()
        assert all(done.ok for tier in self.tiers for done in tier.poll())

    def move_failing_on(self, kind: str, failing: int, order: list[int]) -> tuple[int, list[str]]:
        """Fetch `KEY` or write back `FRESH` (`kind`) with rank `failing`'s I/O failing, deliver the ranks' reports
        in `order`, checking the rule after each; the job's id and what the checks found."""
        if kind == "fetch":
            self.planner.fetch_missing([KEY], 0, step=0)
        else:
            plan = self.manager.prepare_store([FRESH], 1)
            assert plan is not None
            self.manager.mark_submitted(plan.slots)
            self.manager.complete_store(plan.slots, True)
            self.planner.stored([FRESH])
        orders = self.planner.orders(0)
        assert [(o.kind, o.keys) for o in orders] == [(kind, (KEY if kind == "fetch" else FRESH,))]
        for runner in self.runners:
            runner.submit(orders)
        if kind == "fetch":
            self.disk_io[failing].read_errno = errno.EIO
        else:
            self.disk_io[failing].write_errno = errno.EIO
        self.io.run_all()
        reports = [runner.poll() for runner in self.runners]
        assert [bool(r.failed) for (r,) in reports] == [rank == failing for rank in range(RANKS)]
        found: list[str] = []
        for rank in order:
            (report,) = reports[rank]
            self.planner.report(rank, report, step=1)
            found += check_all(self.world, ["tier-job-every-rank"]).get("tier-job-every-rank", [])
        return orders[0].job_id, found

    def close(self) -> None:
        for runner in self.runners:
            runner.close()


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[TwoRanks]:
    opened = TwoRanks(tmp_path)
    yield opened
    opened.close()


def failed_everywhere(ranks: TwoRanks, kind: str, failing: int, order: str) -> TierJob:
    """Move a block with rank `failing`'s I/O failing, the reports in `order`: the job, which must have failed its
    key with the rule holding after every report."""
    job_id, found = ranks.move_failing_on(kind, failing, ORDERS[order](failing))
    assert found == []
    job = ranks.world.tier_jobs[job_id]
    assert job.state == Job.FAILED and job.failed_keys == ((KEY if kind == "fetch" else FRESH),)
    return job


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("failing", range(RANKS))
def test_a_fetch_one_rank_failed_and_another_read_fails_everywhere_and_frees_its_slot(
        ranks: TwoRanks, failing: int, order: str) -> None:
    job = failed_everywhere(ranks, "fetch", failing, order)
    (slot,) = job.cpu_slots
    assert ranks.manager.blocks[slot].state == Cpu.FREE, "a CPU block with one rank's heads stale stays in the pool"
    assert ranks.planner.stats.failures == {"io-error": 1}


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("failing", range(RANKS))
def test_a_write_back_one_rank_failed_and_another_wrote_fails_everywhere_and_is_not_counted(
        ranks: TwoRanks, failing: int, order: str) -> None:
    job = failed_everywhere(ranks, "write-back", failing, order)
    assert ranks.planner.stats.blocks_written_back["disk"] == 0, "a block one rank failed to write counted as written"
    ranks.planner.stored([FRESH])
    assert ranks.planner.orders(1) == (), "a write-back some rank failed was ordered again"
    (slot,) = job.cpu_slots
    assert ranks.manager.blocks[slot].state == Cpu.READY, "the CPU block itself is whole: it stays loadable"


@pytest.mark.parametrize("kind", ["fetch", "write-back"])
@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("failing", range(RANKS))
def test_control_ending_a_tier_job_on_its_first_report_is_caught_by_tier_job_every_rank(
        ranks: TwoRanks, failing: int, order: str, kind: str) -> None:
    TIER_RANK_CONTROLS["tier-first-report"](ranks.planner)
    _, found = ranks.move_failing_on(kind, failing, ORDERS[order](failing))
    assert found, "the control ended the fetch on one rank's report and the rule saw nothing"
