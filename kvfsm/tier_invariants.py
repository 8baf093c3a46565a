"""The Python predicates behind the lower-tier invariants of `tier-entry` and `tier-job`.

They read the same `kvfsm.invariants.World` as the CPU tier's predicates, through its `tiers` (the open lower
tiers, whose `entries` are the tier-entry records), `tier_jobs` (every write-back and fetch of the run) and
`writeback_bound`. Each returns one readable line per violation; `[]` means the rule holds.
"""

from __future__ import annotations

from collections import Counter

from kvfsm.config import REPLICATED_TIER_RANK
from kvfsm.invariants import World
from kvfsm.registry import REGISTRY
from kvfsm.states import CpuBlockState as Cpu
from kvfsm.states import TierEntryState as Entry
from kvfsm.states import TierJobState as Job


@REGISTRY.invariant("publish-after-write")
def publish_after_write(world: World) -> list[str]:
    """The records' half of the rule; the bytes half (a published key holds its prefix's exact bytes) needs the data
    oracle and is checked by `kvfsm.testing.harness.Harness` under the same name."""
    found = []
    for tier in world.tiers:
        for entry in tier.entries:
            if entry.state == Entry.WRITING and entry.checksum is not None:
                found.append(f"{tier.name}: key {entry.key:#x} is writing but already has a checksum")
            if entry.state in (Entry.PUBLISHED, Entry.READING) and entry.checksum is None and not entry.adopted:
                found.append(f"{tier.name}: key {entry.key:#x} is {entry.state} without a checksum")
    return found


@REGISTRY.invariant("disk-block-whole")
def disk_block_whole(world: World) -> list[str]:
    """The files half of the rule, over every tier that keeps blocks in files (`torn_visible`): no file under a
    block's name is short or long, whichever process wrote it. The reads half (a block is used only after its record
    and CRC-32 verified) is the block files' `read`, whose control `unverified-read` the bytes checks catch."""
    return [f"{tier.name}: {name} is visible under its block's name but not whole"
            for tier in world.tiers for name in getattr(tier, "torn_visible", list)()]


@REGISTRY.invariant("lookup-published")
def lookup_published(world: World) -> list[str]:
    return [f"{tier.name}: a lookup counted key {key:#x} while it was {state}"
            for tier in world.tiers for key, state in tier.entries.lookups if state != Entry.PUBLISHED]


@REGISTRY.invariant("read-pins-entry")
def read_pins_entry(world: World) -> list[str]:
    """Each tier's entries against the reads that tier has in flight, both the worker's records. Not against the
    scheduler's fetch jobs: the scheduler hears of a read's end with the worker's report, `report_lag` steps late
    under async scheduling, so a fetch it still counts in flight may have read its key already, which is rightly
    published (evictable) again; the CPU slots such a fetch filled stay held until the report
    (`fetch-lands-private`)."""
    found = []
    for tier in world.tiers:
        readers = Counter(tier.reads_in_flight())
        for entry in tier.entries:
            n = readers.pop(entry.key, 0)
            if entry.state == Entry.READING and n != 1:
                found.append(f"{tier.name}: key {entry.key:#x} is reading with {n} reads in flight")
            if n and entry.state != Entry.READING:
                found.append(f"{tier.name}: key {entry.key:#x} is {entry.state} while a read holds it")
            if n > 1:
                found.append(f"{tier.name}: key {entry.key:#x} has {n} reads in flight")
        found += [f"{tier.name}: key {key:#x} is gone while a read holds it" for key in readers]
    return found


def _in_flight(world: World, kind: str) -> Counter[int]:
    return Counter(slot for job in world.tier_jobs.values() if job.kind == kind and job.in_flight
                   for slot in job.cpu_slots)


@REGISTRY.invariant("writeback-pins-slot")
def writeback_pins_slot(world: World) -> list[str]:
    writers = _in_flight(world, "write-back")
    found = [f"CPU slot {slot} has {n} write-backs in flight" for slot, n in writers.items() if n > 1]
    for block in world.cpu_blocks:
        n = writers.get(block.slot, 0)
        if n and block.state not in (Cpu.WRITING_BACK, Cpu.ORPHANED):
            found.append(f"CPU slot {block.slot} is {block.state} while a write-back reads it")
        if block.state == Cpu.WRITING_BACK and n != 1:
            found.append(f"CPU slot {block.slot} is writing-back with {n} write-backs in flight")
    return found


@REGISTRY.invariant("eager-every-tier")
def eager_every_tier(world: World) -> list[str]:
    """Checked at idle, when every eager write-back the planner queued was ordered or dropped: each ready block a
    store wrote was offered to each eager tier (a write-back of it to that tier was ordered, whatever its end) or
    that tier has it (published by an earlier write-back, or read from it). Reads the run's history (ended stores
    and tier jobs); a store it no longer keeps makes its block unchecked rather than flagged."""
    if not world.idle or not world.eager_tiers:
        return []
    stores = {job.job_id for job in world.jobs.values() if job.kind == "store"}
    offered = {(job.tier, key) for job in world.tier_jobs.values() for key in job.keys}
    found = []
    for tier in world.tiers:
        if tier.name not in world.eager_tiers:
            continue
        held = {entry.key for entry in tier.entries}
        found += [f"{tier.name}: CPU slot {block.slot}'s stored key {block.block_hash:#x} was never offered to it"
                  for block in world.cpu_blocks
                  if block.state == Cpu.READY and block.writer_job in stores and block.block_hash is not None
                  and (tier.name, block.block_hash) not in offered and block.block_hash not in held]
    return found


@REGISTRY.invariant("fetch-waits-for-room")
def fetch_waits_for_room(world: World) -> list[str]:
    """Read from the scheduler's latest lookups whose tier hit found no CPU slot to claim: each that found busy slots
    and wanted no more keys than the pool holds must have waited for some job; one that waited for none answered a
    miss, and the engine recomputes a prefix the tier holds."""
    capacity = len(world.cpu_blocks)
    return [f"a lookup met a lower tier's hit with {each.busy} CPU slots busy and answered a miss, though the pool "
            f"of {capacity} holds its {each.wanted} keys once their jobs end"
            for each in world.room_lookups if each.busy and each.wanted <= capacity and not each.waited]


@REGISTRY.invariant("fetch-lands-private")
def fetch_lands_private(world: World) -> list[str]:
    fetches = _in_flight(world, "fetch")
    transfers = Counter(slot for job in world.jobs.values() if job.in_flight for slot in job.cpu_slots)
    found = [f"CPU slot {slot} has {n} fetches in flight" for slot, n in fetches.items() if n > 1]
    for block in world.cpu_blocks:
        n = fetches.get(block.slot, 0)
        if n and block.state not in (Cpu.FETCHING, Cpu.ORPHANED):
            found.append(f"CPU slot {block.slot} is {block.state} while a fetch writes it")
        if n and transfers.get(block.slot):
            found.append(f"CPU slot {block.slot} is written by a fetch and moved by a transfer at once")
        if block.state == Cpu.FETCHING and n != 1:
            found.append(f"CPU slot {block.slot} is fetching with {n} fetches in flight")
        writer = world.tier_jobs.get(block.writer_job) if block.writer_job is not None else None
        landed = writer is not None and (writer.state == Job.DONE or (
            writer.state == Job.FAILED and block.block_hash not in writer.failed_keys))  # a failed job's other keys
        if writer is not None and block.state in (Cpu.READY, Cpu.LOADING, Cpu.WRITING_BACK) and not landed:
            found.append(f"CPU slot {block.slot} is {block.state} but the fetch that fills it is {writer.state}")
    return found


@REGISTRY.invariant("lost-key-is-miss")
def lost_key_is_miss(world: World) -> list[str]:
    found = []
    for job in world.tier_jobs.values():
        if job.kind != "fetch" or job.state != Job.FAILED:
            continue
        if job.job_id not in world.reported_failed:
            found.append(f"fetch {job.job_id} failed without being reported")
        for key, slot in zip(job.keys, job.cpu_slots):
            block = world.cpu_blocks[slot]
            if key in job.failed_keys and block.writer_job == job.job_id and block.state not in (Cpu.FREE, Cpu.ORPHANED,
                                                                                                 Cpu.FETCHING):
                found.append(f"fetch {job.job_id} failed for key {key:#x} but left CPU slot {slot} {block.state}")
    return found


@REGISTRY.invariant("late-io-holds-slot")
def late_io_holds_slot(world: World) -> list[str]:
    held = {"fetch": (Cpu.ORPHANED,), "write-back": (Cpu.ORPHANED,)}
    return [f"{job.kind} {job.job_id} was abandoned at its deadline but its CPU slot {slot} is "
            f"{world.cpu_blocks[slot].state}"
            for job in world.tier_jobs.values() if job.state == Job.ABANDONED
            for slot in job.cpu_slots if world.cpu_blocks[slot].state not in held[job.kind]]


@REGISTRY.invariant("writeback-bounded")
def writeback_bounded(world: World) -> list[str]:
    in_flight = sum(job.nbytes for job in world.tier_jobs.values() if job.kind == "write-back" and job.in_flight)
    bound = world.writeback_bound
    return [f"{in_flight} bytes of write-backs in flight, bound {bound}"] if in_flight > bound else []


@REGISTRY.invariant("writeback-queue-bounded")
def writeback_queue_bounded(world: World) -> list[str]:
    return [f"{tier}: {queued} stored blocks wait for their write-back, bound {bound}"
            for tier, (queued, bound) in world.writeback_queues.items() if bound is not None and queued > bound]


@REGISTRY.invariant("tier-job-every-rank")
def tier_job_every_rank(world: World) -> list[str]:
    found = []
    for job in world.tier_jobs.values():
        if job.in_flight or job.state == Job.SHED:  # a shed write-back never reached a rank
            continue
        if len(job.reports) != world.num_workers:
            found.append(f"{job.kind} {job.job_id} is {job.state} with reports from ranks {sorted(job.reports)} "
                         f"of {world.num_workers}")
        failed = {key for report in job.reports.values() for key, _ in report.failed}
        if job.state == Job.DONE and failed:
            found.append(f"{job.kind} {job.job_id} is done although some rank failed keys "
                         f"{[hex(k) for k in sorted(failed)]}")
        elif missed := failed - set(job.failed_keys):
            found.append(f"{job.kind} {job.job_id} ended without failing keys {[hex(k) for k in sorted(missed)]} "
                         "some rank failed")
    return found


@REGISTRY.invariant("replicated-one-tier-move")
def replicated_one_tier_move(world: World) -> list[str]:
    """Read from each rank's report of a tier job, which says whether that rank's runner handed the job to its tiers
    (`TierReport.moved`): with replicated KV `REPLICATED_TIER_RANK` alone moved it, without it every rank did."""
    found = []
    for job in world.tier_jobs.values():
        moved = sorted(rank for rank, report in job.reports.items() if report.moved)
        idle = sorted(rank for rank, report in job.reports.items() if not report.moved)
        if world.replicated and (extra := [rank for rank in moved if rank != REPLICATED_TIER_RANK]):
            found.append(f"{job.kind} {job.job_id} of replicated KV was moved by ranks {moved}; only rank "
                         f"{REPLICATED_TIER_RANK} moves it (ranks {extra} moved the one shared copy again)")
        if world.replicated and REPLICATED_TIER_RANK in idle:
            found.append(f"{job.kind} {job.job_id} of replicated KV was moved by no rank")
        if not world.replicated and idle:
            found.append(f"{job.kind} {job.job_id}: ranks {idle} moved none of their heads' share")
    return found
