"""The Python predicates behind the spec's named invariants.

Each predicate takes a `World` (a snapshot of the connector, the pool and, on `SimDevice`, the log of every
access the device executed) and returns the violations it finds, one readable line each; `[]` means it holds.

The ordering invariants share one rule: two accesses to the same block and layer, at least one of them a write,
must execute in the order the host issued them. Each invariant owns the pairs of actors its hazard is about, so a
violation names the hazard (a store that read before compute wrote is `store-after-compute`; a load that wrote
while a store still read is `load-after-readers`). An access names one layer segment or every layer of its
blocks; the per-layer invariants own the pairs where the engine's side of the hazard is a per-layer access
(compute waiting on one layer's load, a store of one layer).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, NamedTuple, Protocol, Sequence

from kvfsm.executor.access import Access, Actor, Mode, Space
from kvfsm.records import FLUSHABLE_JOB_STATES, CpuBlock, GpuBlock, RequestRecord, TransferJob
from kvfsm.registry import REGISTRY
from kvfsm.states import CpuBlockState as C
from kvfsm.states import GpuBlockState as G
from kvfsm.states import RequestState as R
from kvfsm.states import TierJobState as T
from kvfsm.states import TransferJobState as J
from kvfsm.tier_records import TierEntry, TierJob


class Deferral(NamedTuple):
    """A request deferred at `step` because these jobs were in flight on blocks it needs. A named tuple, not a frozen
    dataclass: one is made per deferred lookup, and a tuple is built in C where a frozen dataclass's `__init__` sets
    each field through `object.__setattr__`."""

    step: int
    blockers: frozenset[int]


@dataclass(frozen=True, slots=True)
class RoomLookup:
    """A lookup whose lower-tier hit found no CPU slot to claim for its fetch (`fetch-waits-for-room`): the request's
    `wanted` leading keys the fetch needed in the pool, the pool's `busy` slots then (storing, loading, written back
    or fetching), and the jobs it `waited` for (none: answered as a miss)."""

    wanted: int
    busy: int
    waited: frozenset[int]


class TierEntriesView(Protocol):
    """What the invariants read of a lower tier's index (`kvfsm.tiers.entries.TierEntries`)."""

    lookups: list[tuple[int, str]]

    def __iter__(self) -> Iterator[TierEntry]: ...


class TierView(Protocol):
    """What the invariants read of a lower tier (`kvfsm.tiers.base.LowerTier`)."""

    name: str
    entries: TierEntriesView

    def reads_in_flight(self) -> list[int]: ...


class World(Protocol):
    cpu_blocks: Sequence[CpuBlock]
    catalogue: Mapping[int, int]  # prefix hash -> CPU slot
    jobs: Mapping[int, TransferJob]  # every job of the run, finished ones included
    requests: Mapping[str, RequestRecord]
    gpu_blocks: Mapping[int, GpuBlock]
    deferrals: Mapping[str, Deferral]
    reported_failed: set[int]  # job ids reported failed to the scheduler
    accesses: Sequence[Access]  # empty when the device keeps no log (CUDA)
    idle: bool
    tiers: Sequence[TierView]  # the open lower tiers, in lookup order
    tier_jobs: Mapping[int, TierJob]  # every write-back and fetch of the run (ids shared with `jobs`)
    writeback_bound: int  # configured bound on the bytes of write-backs in flight
    store_bound: int | None  # configured bound on the CPU blocks of stores in flight (None: the pool alone)
    writeback_queues: Mapping[str, tuple[int, int | None]]  # each eager tier: (blocks queued, bound or None)
    eager_tiers: frozenset[str]  # the lower tiers whose write-back policy is eager
    room_lookups: Sequence[RoomLookup]  # the latest lookups whose tier hit found no CPU slot for its fetch
    num_workers: int  # ranks whose reports a job waits for
    rank: int  # the rank whose device log `accesses` is
    replicated: bool  # every rank holds the same KV and the ranks share one host pool
    async_scheduling: bool  # the engine schedules each step before it read the previous step's output


Pair = tuple[tuple[Actor, Mode], tuple[Actor, Mode]]
Which = Callable[[Access, Access], bool]
"""Whether an (earlier-issued, later-issued) conflicting pair belongs to the invariant asking."""


def _any_pair(early: Access, late: Access) -> bool:
    return True


def _overlap(a: Access, b: Access) -> bool:
    return a.layer is None or b.layer is None or a.layer == b.layer


def _ordering(world: World, pairs: set[Pair], space: Space, which: Which = _any_pair) -> list[str]:
    """Conflicting accesses in `pairs` (earlier-issued, later-issued) that executed out of issue order."""
    by_block: dict[int, list[Access]] = defaultdict(list)
    for access in world.accesses:
        if access.space == space:
            by_block[access.block].append(access)
    found = []
    for block, accesses in by_block.items():
        accesses.sort(key=lambda a: a.executed)
        for i, late in enumerate(accesses):
            for early in accesses[i + 1:]:
                # `early` was issued before `late` but executed after it.
                if (early.issued < late.issued and ((early.actor, early.mode), (late.actor, late.mode)) in pairs
                        and _overlap(early, late) and which(early, late)):
                    named = early.layer if early.layer is not None else late.layer
                    layer = "" if named is None else f" layer {named}"
                    found.append(
                        f"{space} block {block}{layer}: {late.label} ({late.mode}) ran before {early.label} "
                        f"({early.mode}), which was issued first"
                    )
    return found


USE_AFTER_LOAD: set[Pair] = {(("load", "write"), ("compute", "read")), (("load", "write"), ("compute", "write"))}


@REGISTRY.invariant("store-after-compute")
def store_after_compute(world: World) -> list[str]:
    return _ordering(world, {(("compute", "write"), ("store", "read"))}, "gpu", lambda _, store: store.layer is None)


@REGISTRY.invariant("layer-store-after-compute")
def layer_store_after_compute(world: World) -> list[str]:
    return _ordering(world, {(("compute", "write"), ("store", "read"))}, "gpu",
                     lambda _, store: store.layer is not None)


@REGISTRY.invariant("fence")
def fence(world: World) -> list[str]:
    return _ordering(world, {(("store", "read"), ("compute", "write"))}, "gpu", lambda store, _: store.layer is None)


@REGISTRY.invariant("layer-stores-flushed")
def layer_stores_flushed(world: World) -> list[str]:
    return _ordering(world, {(("store", "read"), ("compute", "write"))}, "gpu",
                     lambda store, _: store.layer is not None)


@REGISTRY.invariant("load-after-readers")
def load_after_readers(world: World) -> list[str]:
    earlier = {("compute", "read"), ("compute", "write"), ("store", "read")}
    return _ordering(world, {(use, ("load", "write")) for use in earlier}, "gpu")


@REGISTRY.invariant("load-before-use")
def load_before_use(world: World) -> list[str]:
    return _ordering(world, USE_AFTER_LOAD, "gpu", lambda _, compute: compute.layer is None)


@REGISTRY.invariant("layer-load-before-use")
def layer_load_before_use(world: World) -> list[str]:
    return _ordering(world, USE_AFTER_LOAD, "gpu", lambda _, compute: compute.layer is not None)


@REGISTRY.invariant("readers-pin")
def readers_pin(world: World) -> list[str]:
    found = [
        f"CPU slot {b.slot} is {b.state} with {b.readers} readers"
        for b in world.cpu_blocks
        if b.readers < 0
        or (b.readers > 0 and b.state not in (C.LOADING, C.ORPHANED))
        or (b.state == C.LOADING and b.readers != 1)
    ]
    return found + _ordering(world, {(("load", "read"), ("store", "write"))}, "cpu")


@REGISTRY.invariant("ready-means-written")
def ready_means_written(world: World) -> list[str]:
    found = []
    for block_hash, slot in world.catalogue.items():
        block = world.cpu_blocks[slot]
        if block.block_hash != block_hash or block.state in (C.FREE, C.ORPHANED):
            found.append(f"hash {block_hash:#x} is catalogued at CPU slot {slot}, which is {block.state}")
    return found + _ordering(world, {(("store", "write"), ("load", "read"))}, "cpu")


@REGISTRY.invariant("single-load")
def single_load(world: World) -> list[str]:
    loads = Counter(slot for job in world.jobs.values() if job.kind == "load" and job.in_flight for slot in job.cpu_slots)
    return [f"CPU slot {slot} has {n} loads in flight" for slot, n in loads.items() if n > 1]


@REGISTRY.invariant("pool-accounting")
def pool_accounting(world: World) -> list[str]:
    found = []
    catalogued = set(world.catalogue.values())
    if len(catalogued) != len(world.catalogue):
        found.append("two hashes share one CPU slot")
    for block in world.cpu_blocks:
        listed = block.slot in catalogued
        should = block.state not in (C.FREE, C.ORPHANED)
        if listed != should:
            found.append(f"CPU slot {block.slot} is {block.state} but {'is' if listed else 'is not'} catalogued")
        if not should and block.block_hash is not None:
            found.append(f"CPU slot {block.slot} is {block.state} but still names hash {block.block_hash:#x}")
    return found


@REGISTRY.invariant("failure-visible")
def failure_visible(world: World) -> list[str]:
    found = []
    for job in world.jobs.values():
        if job.state != J.FAILED:
            continue
        if job.job_id not in world.reported_failed:
            found.append(f"{job.kind} job {job.job_id} failed without being reported")
        if job.kind == "store":
            for slot in job.cpu_slots:
                block = world.cpu_blocks[slot]
                if block.writer_job == job.job_id and block.state in (C.READY, C.LOADING):
                    found.append(f"failed store job {job.job_id} left CPU slot {slot} {block.state}")
    return found


@REGISTRY.invariant("one-kind-of-job")
def one_kind_of_job(world: World) -> list[str]:
    found = []
    for request in world.requests.values():
        kinds = Counter(job.kind for job in request.jobs_in_flight)
        if kinds["load"] > 1 or (kinds["load"] and kinds["store"]):
            found.append(f"request {request.req_id} has {dict(kinds)} jobs in flight")
    return found


@REGISTRY.invariant("skipped-not-stored")
def skipped_not_stored(world: World) -> list[str]:
    found = []
    for job in world.jobs.values():
        request = world.requests.get(job.req_id) if job.kind == "store" else None
        if request is None or not request.skipped:
            continue
        carried = [h for h in job.hashes if h in request.skipped]
        if carried:
            found.append(f"store job {job.job_id} of request {job.req_id} carries {len(carried)} block(s) admission "
                         f"skipped ({request.skipped[carried[0]]}), e.g. {carried[0]:#x}")
    return found


@REGISTRY.invariant("stores-bounded")
def stores_bounded(world: World) -> list[str]:
    bound = world.store_bound
    if bound is None:
        return []
    in_flight = sum(len(job.cpu_slots) for job in world.jobs.values() if job.kind == "store" and job.in_flight)
    return [f"{in_flight} CPU blocks of stores in flight, bound {bound}"] if in_flight > bound else []


LOAD_OWNER_STATES = frozenset({R.LOADING, R.LOADING_INLINE, R.DRAINING})
"""Where a request may be while its load is in flight: draining once finished or aborted, never preempted (an
engine preempts a request only once its inline load was reported)."""


@REGISTRY.invariant("inline-load-outlives-request")
def inline_load_outlives_request(world: World) -> list[str]:
    found = []
    for job in world.jobs.values():
        if job.kind != "load" or not job.in_flight:
            continue
        owner = world.requests.get(job.req_id)
        state = owner.state if owner is not None else R.RELEASED
        if state not in LOAD_OWNER_STATES:
            found.append(f"load job {job.job_id} is {job.state} while its request {job.req_id} is {state}")
        unpinned = [slot for slot in job.cpu_slots if world.cpu_blocks[slot].readers == 0]
        if unpinned:
            found.append(f"load job {job.job_id} is {job.state} but its CPU slots {unpinned} are not pinned")
    return found


@REGISTRY.invariant("inline-load-in-step")
def inline_load_in_step(world: World) -> list[str]:
    return [f"load job {job.job_id} was computed on in step {job.due_output} but reported in output "
            f"{job.reported_output}"
            for job in world.jobs.values()
            if job.due_output is not None and job.reported_output is not None
            and job.reported_output != job.due_output]


@REGISTRY.invariant("no-inline-load-under-async-scheduling")
def no_inline_load_under_async_scheduling(world: World) -> list[str]:
    if not world.async_scheduling:
        return []
    return [f"load job {job.job_id} of request {job.req_id} is computed on in its own step, but the engine schedules "
            "each step before it read the previous step's output: its failure would come after the next step "
            "computed on it" for job in world.jobs.values() if job.inline]


ENDED = frozenset({J.DONE, J.FAILED, T.DONE, T.FAILED, T.ABANDONED})
"""Job states whose outcome is final for the scheduler (an abandoned tier job's I/O may still run, but its request
no longer waits on it): each was entered by a transition that records the step."""


@REGISTRY.invariant("no-convoy")
def no_convoy(world: World) -> list[str]:
    found = []
    for req_id, deferral in world.deferrals.items():
        request = world.requests.get(req_id)
        if request is None or request.state != R.DEFERRED:
            continue
        blockers = [world.jobs.get(j) or world.tier_jobs[j] for j in deferral.blockers]
        # The check reads when each blocker ended: a blocker that ended without saying when would blind it.
        found += [f"job {job.job_id}, which deferred request {req_id}, is {job.state} with no finish step"
                  for job in blockers if job.state in ENDED and job.finished_step is None]
        stale = [job.finished_step for job in blockers
                 if job.finished_step is not None and job.finished_step < deferral.step]
        if not deferral.blockers or len(stale) == len(deferral.blockers):
            found.append(f"request {req_id} was deferred at step {deferral.step} with nothing in flight to wait for")
    return found


@REGISTRY.invariant("standing-deferral")
def standing_deferral(world: World) -> list[str]:
    found = []
    for req_id, deferral in world.deferrals.items():
        request = world.requests.get(req_id)
        if request is None or request.state != R.DEFERRED or request.standing is None:
            continue
        if not deferral.blockers:
            found.append(f"request {req_id} was answered at step {request.standing} from a deferral that waits on "
                         "nothing")
        blockers = [world.jobs.get(j) or world.tier_jobs[j] for j in deferral.blockers]
        # A job that ended by the step of the lookup ended before it (a job ends as a step's output is read, the
        # next step's lookups come after): the request had to be looked up again then, not kept waiting.
        found += [f"request {req_id} was answered at step {request.standing} from its standing deferral, but job "
                  f"{job.job_id} it waits on ended at step {job.finished_step}"
                  for job in blockers if job.finished_step is not None and job.finished_step <= request.standing]
    return found


@REGISTRY.invariant("preempt-flushes")
def preempt_flushes(world: World) -> list[str]:
    return [
        f"preempted request {r.req_id} has store job {j.job_id} still {j.state}"
        for r in world.requests.values()
        if r.state == R.PREEMPTED
        for j in r.jobs.values()
        if j.kind == "store" and j.state in FLUSHABLE_JOB_STATES
    ]


@REGISTRY.invariant("drained")
def drained(world: World) -> list[str]:
    if not world.idle:
        return []
    found = [f"{j.kind} job {j.job_id} is still {j.state}" for j in world.jobs.values() if j.in_flight]
    found += [f"CPU slot {b.slot} still has {b.readers} readers" for b in world.cpu_blocks if b.readers]
    settled = sum(b.state in (C.FREE, C.READY) for b in world.cpu_blocks)
    if settled != len(world.cpu_blocks):
        found.append(f"free + ready = {settled} of {len(world.cpu_blocks)} CPU slots")
    found += [f"GPU block {b.block_id} is still fenced" for b in world.gpu_blocks.values() if b.state != G.WRITABLE]
    found += [f"{job.kind} {job.job_id} is still {job.state}" for job in world.tier_jobs.values() if job.in_flight]
    found += [f"{tier.name}: key {entry.key:#x} is still {entry.state}" for tier in world.tiers
              for entry in tier.entries if entry.state in ("writing", "reading")]
    return found


def check_all(world: World, names: Sequence[str] | None = None) -> dict[str, list[str]]:
    """Every registered invariant (or those named) that does not hold, with its violations."""
    selected = names if names is not None else list(REGISTRY.invariants)
    results = {name: REGISTRY.invariants[name](world) for name in selected}
    return {name: found for name, found in results.items() if found}
