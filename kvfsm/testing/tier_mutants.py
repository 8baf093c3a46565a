"""Controls for the lower-tier invariants: kvfsm with one tier rule removed, each caught by some interleaving.

Each patches one running engine + connector (instance attributes only), like `kvfsm.testing.mutants`; those of
`disk-block-whole` (`DISK_FILE_MUTANTS`) patch one disk tier, and the shared-directory tests stage what shows them.
"""

from __future__ import annotations

import os
import zlib
from collections import deque
from typing import Any, Callable, Iterable, Sequence

from kvfsm.connector import Connector
from kvfsm.connector.ranks import TierOutcome
from kvfsm.engine.engine import Engine
from kvfsm.tiers.blockfile import RECORD
from kvfsm.tiers.base import TierSite
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.factory import open_tiers
from kvfsm.connector.tier_planner import TierPlanner
from kvfsm.tier_records import TierEntry, TierJob


def _disk(connector: Connector) -> DiskTier:
    return next(t for t in connector.worker.lower_tiers if isinstance(t, DiskTier))


def _planner(connector: Connector) -> TierPlanner:
    planner = connector.scheduler.tiers
    assert planner is not None
    return planner


def publish_before_written(engine: Engine, connector: Connector) -> None:
    """A write is acknowledged (and its key published) when queued; the bytes land in a later I/O operation."""
    disk = _disk(connector)
    io, write = disk._io, disk.files.write

    def acknowledge_then_write(key: int, source: memoryview, carried: int | None = None) -> int:
        io.submit(lambda: write(key, source, carried))
        return zlib.crc32(source) if carried is None else carried

    disk.files.write = acknowledge_then_write  # type: ignore[method-assign]


def lookup_counts_writing(engine: Engine, connector: Connector) -> None:
    """A lookup counts keys whose write is still in flight."""
    entries = _disk(connector).entries

    def lookup(keys: Sequence[int]) -> int:
        count = 0
        for key in keys:
            entry = entries.by_key.get(key)
            if entry is None or entry.state not in ("published", "writing"):
                break
            count += 1
        entries.lookups.extend((key, entries.by_key[key].state) for key in keys[:count])
        return count

    entries.lookup = lookup  # type: ignore[method-assign]


def unpinned_tier_read(engine: Engine, connector: Connector) -> None:
    """A fetch does not pin the entry it reads: the tier may evict and rewrite it under the read."""
    entries = _disk(connector).entries
    pin, read_done = entries.pin, entries.read_done

    def pin_then_release(key: int) -> TierEntry | None:
        entry = pin(key)
        if entry is not None:
            read_done(entry)
        return entry

    def done_if_reading(entry: TierEntry) -> None:
        if entry.state == "reading":
            read_done(entry)

    entries.pin = pin_then_release  # type: ignore[method-assign]
    entries.read_done = done_if_reading  # type: ignore[method-assign]


def unpinned_write_back(engine: Engine, connector: Connector) -> None:
    """A write-back reads its CPU slot without pinning it: eviction and stores may rewrite it mid-write."""
    manager = connector.scheduler.manager
    manager.pin_for_write_back = lambda slots: None  # type: ignore[method-assign]
    manager.complete_write_back = lambda slots: None  # type: ignore[method-assign]
    manager.abandon_write_back = lambda slots: None  # type: ignore[method-assign]


def fetch_ready_early(engine: Engine, connector: Connector) -> None:
    """A fetch's CPU slots are marked ready when it is ordered, not when its bytes arrived."""
    manager = connector.scheduler.manager
    prepare, complete = manager.prepare_fetch, manager.complete_fetch

    def prepare_ready(hashes: Sequence[int], job_id: int) -> object:
        plan = prepare(hashes, job_id)
        if plan is not None:
            complete(plan.slots, True)
        return plan

    manager.prepare_fetch = prepare_ready  # type: ignore[method-assign,assignment]
    manager.complete_fetch = lambda slots, success: None  # type: ignore[method-assign]


def failed_fetch_loads(engine: Engine, connector: Connector) -> None:
    """A failed fetch's CPU slots are made ready anyway, as if the key had been read."""
    manager = connector.scheduler.manager
    complete = manager.complete_fetch
    manager.complete_fetch = lambda slots, success: complete(slots, True)  # type: ignore[method-assign]


def free_at_deadline(engine: Engine, connector: Connector) -> None:
    """A fetch failed at its deadline frees its CPU slots at once, though its read may still land in them."""
    ledger = connector.scheduler.ledger
    couple = ledger.couple
    freed: set[int] = set()

    def couple_freeing_at_deadline(lifecycle: str, trigger: str, keys: Iterable[Any], cause: Any = None,
                                   **context: Any) -> None:
        if trigger == "abandon-fetch" and cause.kind == "fetch":  # freed now, as if its read had failed
            freed.add(cause.job_id)
            trigger = "fetch-failed"
        elif trigger == "fetch-failed" and cause.job_id in freed:  # its release: nothing left held to free
            return
        couple(lifecycle, trigger, keys, cause=cause, **context)

    ledger.couple = couple_freeing_at_deadline  # type: ignore[method-assign]


def unbounded_write_back(engine: Engine, connector: Connector) -> None:
    """Write-backs are ordered without regard to the bytes already in flight."""
    _planner(connector).bound = 1 << 62


TIER_MUTANTS: tuple[tuple[str, str, Callable[[Engine, Connector], None]], ...] = (
    ("publish-before-written", "publish-after-write (a key visible before its bytes are durable)",
     publish_before_written),
    ("lookup-counts-writing", "lookup-published (a hit on a key still being written)", lookup_counts_writing),
    ("unpinned-tier-read", "read-pins-entry (an entry evicted and rewritten under its fetch)", unpinned_tier_read),
    ("unpinned-write-back", "writeback-pins-slot (a CPU slot rewritten while written back)", unpinned_write_back),
    ("fetch-ready-early", "fetch-lands-private (a load of a slot before its fetch landed)", fetch_ready_early),
    ("failed-fetch-loads", "lost-key-is-miss (a key gone between lookup and fetch loaded anyway)",
     failed_fetch_loads),
    ("free-at-deadline", "late-io-holds-slot (a late read lands in a reused CPU slot)", free_at_deadline),
    ("unbounded-write-back", "writeback-bounded (write-backs flood the disk)", unbounded_write_back),
)


def tier_first_report(planner: TierPlanner) -> None:
    """A tier job ends on the first rank's report (later ones are only logged): a fetch one rank read and another
    failed is loadable, or freed while another rank's read still lands in it. A control for tensor parallelism:
    with one worker it is kvfsm, so it is not among `TIER_MUTANTS` (the one-worker interleavings)."""

    def first_report(job: TierJob) -> TierOutcome | None:
        if len(job.reports) != 1:
            return None
        report = next(iter(job.reports.values()))
        return TierOutcome(failed=dict(report.failed), held=report.held)

    planner._outcome = first_report  # type: ignore[method-assign]


TIER_RANK_CONTROLS: dict[str, Callable[[TierPlanner], None]] = {"tier-first-report": tier_first_report}
"""Controls of the tier planner that differ from kvfsm only with several workers (`tier-job-every-rank`)."""


def every_rank_moves(engine: Engine, connector: Connector) -> None:
    """Replicated KV: every rank opens its lower tiers and moves every tier job, as each rank moved its own heads'
    share without replicated KV: each block is written back once per rank, and each fetch read into the one shared
    slot once per rank (a rank whose tier never held the key fails the fetch everywhere). A control of replicated
    KV with a lower tier, which the tensor-parallel interleavings never open, so it is in neither `TIER_MUTANTS` nor
    `TP_MUTANTS`; apply it before the first step."""
    for worker in connector.workers:
        runner = worker._tiers
        assert runner is not None, "every-rank-moves needs a lower tier"
        if not runner.tiers:
            site = TierSite(worker.config, worker.pool.slot_bytes, worker.worker, worker._caches, worker.pool)
            runner.tiers = {tier.name: tier for tier in open_tiers(site, worker._tier_io, False, worker._machines)}
        runner.moves = lambda job_id: True


REPLICATED_TIER_CONTROLS: dict[str, Callable[[Engine, Connector], None]] = {"every-rank-moves": every_rank_moves}
"""Controls that differ from kvfsm only with replicated KV and a lower tier (`replicated-one-tier-move`)."""


def one_eager_queue(planner: TierPlanner) -> None:
    """Every eager tier reads one write-back queue: the first tier's pick pins the block `writing-back`, and once
    its write ended that tier holds the key and drops it from the queue the next tier would have read, so the next
    tier gets only the blocks the first gave up on. A control for several eager tiers: with one it is kvfsm, so it
    is not among `TIER_MUTANTS` (whose interleavings open one lower tier)."""
    shared: deque[int] = deque()
    planner._eager = dict.fromkeys(planner._eager, shared)


MULTI_TIER_CONTROLS: dict[str, Callable[[TierPlanner], None]] = {"one-eager-queue": one_eager_queue}
"""Controls of the tier planner that differ from kvfsm only with several lower tiers (`eager-every-tier`)."""


def busy_pool_is_miss(planner: TierPlanner) -> None:
    """A lower tier's hit that finds every CPU slot a fetch could claim busy is answered as a miss: nothing fetched,
    nothing waited for, the prefix the tier holds recomputed. It shows only at a lookup that meets a pool full of
    jobs in flight, so its hunts draw pools of at most two slots (`kvfsm.testing.mutants.MUTANTS`);
    `tests/test_tier_room.py` stages that lookup on the planner alone."""
    planner._room_blockers = lambda wanted, busy: frozenset()  # type: ignore[method-assign]


ROOM_CONTROLS: dict[str, Callable[[TierPlanner], None]] = {"busy-pool-is-miss": busy_pool_is_miss}
"""Controls of the tier planner that differ from kvfsm only at a tier hit met with the CPU pool busy
(`fetch-waits-for-room`), applied to a planner alone; `MUTANTS` holds each applied to a whole connector."""


# --- controls of `disk-block-whole`: one disk tier's block files with one half of the rule removed ---------------


def publish_in_place(tier: DiskTier) -> None:
    """A block is written straight under its name: a reader meets it partial while it is written, and a writer
    killed mid-write leaves it torn there."""
    files = tier.files

    def write_in_place(key: int, source: memoryview, carried: int | None = None) -> int:
        checksum = zlib.crc32(source) if carried is None else carried
        fd = os.open(files.path(key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            files.disk.write(fd, [memoryview(files.record(key, checksum)), source])
        finally:
            os.close(fd)
        return checksum

    files.write = write_in_place  # type: ignore[method-assign]


def unverified_read(tier: DiskTier) -> None:
    """A block's file is loaded as found: its record and checksum are not checked."""
    files = tier.files

    def read_unchecked(key: int, destination: memoryview) -> int:
        fd = os.open(files.path(key), os.O_RDONLY)
        try:
            files.disk.read(fd, [memoryview(bytearray(RECORD.size)), destination])
        finally:
            os.close(fd)
        return zlib.crc32(destination)

    files.read = read_unchecked  # type: ignore[method-assign]


DISK_FILE_MUTANTS: tuple[tuple[str, str, Callable[[DiskTier], None]], ...] = (
    ("publish-in-place", "disk-block-whole (a block visible to other engines while partial, or torn by a crash)",
     publish_in_place),
    ("unverified-read", "disk-block-whole (a corrupted, torn or foreign block file loaded)", unverified_read),
)
"""Applied to one tier, not an engine: each shows only with a second engine, a crash or a file changed on disk,
which `tests/test_tiers_disk_shared.py` stages (one process's generated interleavings never meet them)."""


# --- controls of the standing write-back plan: a change the plan reads, left uncounted --------------------------


def touch_uncounted(planner: TierPlanner) -> None:
    """A hit reorders the pool's eviction policy without counting it in the pool's version: the on-evict plan made
    before the hit stands after it, though the policy's next victims are other blocks."""
    manager = planner.manager
    touch = manager.touch

    def quiet_touch(hashes: Sequence[int]) -> None:
        version = manager.version
        touch(hashes)
        manager.version = version

    manager.touch = quiet_touch  # type: ignore[method-assign]


def pool_moves_uncounted(planner: TierPlanner) -> None:
    """A block's transition (a store, an eviction, a write-back's end) is not counted in the pool's version."""
    manager = planner.manager
    manager._fire_many = manager._machine.fire_many  # type: ignore[method-assign]


def tier_moves_uncounted(planner: TierPlanner) -> None:
    """A tier entry's transition (a key published, evicted or dropped) is not counted in the tier's version."""
    for tier in planner.tiers:
        tier.entries._fire = tier.entries._machine.fire  # type: ignore[method-assign]


def reset_keeps_plan(planner: TierPlanner) -> None:
    """A cache reset keeps the standing plan, though it forgot the keys whose write-back failed (the plan left them
    out; a fresh one writes them back again)."""
    reset = planner.reset

    def keep() -> None:
        standing = planner._standing
        reset()
        planner._standing = standing

    planner.reset = keep  # type: ignore[method-assign]


PLAN_CONTROLS: dict[str, Callable[[TierPlanner], None]] = {
    "touch-uncounted": touch_uncounted,
    "pool-moves-uncounted": pool_moves_uncounted,
    "tier-moves-uncounted": tier_moves_uncounted,
    "reset-keeps-plan": reset_keeps_plan,
}
"""Controls of the standing write-back plan (`TierPlanner._plan_stands`): each leaves one change the on-evict plan
reads uncounted, so a plan stands that a fresh one would not make (`tests/test_tier_plan_stands.py`)."""
