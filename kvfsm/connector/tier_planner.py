"""The scheduler half's side of the lower tiers: lookup across tiers, fetches, and the write-back policy.

Lookup order: the CPU pool first, then each lower tier in configured order, each continuing where the one before
stopped. A hit found only below the CPU pool is not loaded from there: it is fetched into claimed CPU slots (state
`fetching`) and the request is *deferred* (the lookup answers None, as vLLM allows) until the fetch completed; its
next lookup then finds ready CPU blocks and loads them like any CPU hit. Deferring instead of making the load wait
on the fetch keeps the GPU load path unchanged (a load only ever reads ready CPU blocks) and costs no GPU blocks
while the disk works; it makes no convoy because a deferral names the fetch it waits for (the `no-convoy` check),
other requests keep being scheduled past it, and a request that needs the same keys meanwhile finds them fetching
and waits on the same fetch instead of starting a second one. A hit below CPU whose fetch finds no slot to claim
(every slot it could evict is fetching, loading, storing or written back) defers on the jobs holding those slots and
is fetched once they ended, unless the pool could never hold the prefix (`fetch-waits-for-room`): answered as a miss,
it would recompute a prefix the tier holds because the pool was busy for a step.

Write-back: each tier's `writeback` policy picks CPU blocks to copy down, `eager` (every stored block, soon after
its store completed) or `on-evict` (the blocks the CPU eviction policy will give up next); either way the blocks
are pinned `writing-back` until the write ended, and the bytes of write-backs in flight stay within
`OffloadConfig.writeback_max_bytes_in_flight` (a candidate that does not fit waits for a later step). A slot is read
by one write-back at a time (`writeback-pins-slot`), so with several tiers its write-backs run one after another:
each eager tier keeps its own queue (`eager-every-tier`), and a block another tier is writing back waits in it
until that write ended, as an on-evict tier's victim does until the next step's plan.

Back-pressure: a tier that falls behind (a slow disk, a saturated store) keeps its eager queue growing with every
store that completes. With the tier's `writeback_max_queued_blocks` the queue holds at most that many blocks: the
blocks a store brings beyond it are shed for that tier at once (`writeback-queue-bounded`), as one write-back job
that goes from created to shed without a CPU slot, so the trace shows each shed and `eager-every-tier` counts the
blocks offered; they are simply never written to that tier (a later miss there), and are counted in
`ConnectorStats.store_shed` under the tier's name.

Bookkeeping is not here: the jobs live on the connector's `Ledger` beside the transfer jobs (one table per kind, one
history policy), their ranks' reports are aggregated as a transfer job's are (`kvfsm.connector.ranks`), and what a
job's end does to its CPU slots is declared as couplings in `tier-job.yaml`, which the ledger fires. What this module
remembers between steps is planning only, each bounded by the CPU pool (per tier) whatever the number of jobs:
each eager tier's write-back queue, the keys whose write-back failed, the write-backs in flight at a cache reset,
which fetch brought each CPU slot's block (for the per-tier statistics), the latest lookups that found no room
for their fetch (what `fetch-waits-for-room` checks), and the last write-back plan if it ordered nothing: it stands,
and is not made again, until the pool or an on-evict tier counts a change (`manager.version`, `plan_version`), so an
idle step does not re-read the eviction policy's next victims and ask the tier about each.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvfsm.config import OffloadConfig
from kvfsm.connector.ledger import Ledger
from kvfsm.connector.metrics import tier_key
from kvfsm.connector.metadata import TierOrder, TierReport
from kvfsm.connector.ranks import TierOutcome, every_rank_tier_outcome
from kvfsm.connector.stats import ConnectorStats
from kvfsm.invariants import RoomLookup
from kvfsm.manager import OffloadingManager
from kvfsm.manager.catalogue import BUSY
from kvfsm.tier_records import TierJob
from kvfsm.states import CpuBlockState as Cpu
from kvfsm.states import TierEntryState, TierJobState
from kvfsm.tiers.base import LowerTier, TierFailure


@dataclass
class TierStats:
    blocks_fetched: Counter[str] = field(default_factory=Counter)
    blocks_written_back: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    """Keys that did not move, by reason (full, io-error, corrupt, missing)."""
    writebacks_held: int = 0
    """Times a write-back candidate waited because the bytes in flight were at the bound."""
    tokens_loaded_from: Counter[str] = field(default_factory=Counter)
    """Tokens loaded into the GPU from CPU blocks that a fetch brought from each tier."""
    hit_blocks: Counter[str] = field(default_factory=Counter)
    """GPU blocks a lookup found in each tier (not in the CPU pool) and ordered fetched."""
    room_waits: int = 0
    """Lookups deferred because a lower tier held their next keys while every CPU slot a fetch could claim was busy."""


class TierPlanner:
    def __init__(self, config: OffloadConfig, tiers: Sequence[LowerTier], manager: OffloadingManager,
                 block_bytes: int, new_job_id: Callable[[], int], ledger: Ledger,
                 connector_stats: ConnectorStats | None = None) -> None:
        """`connector_stats`: the scheduler half's counters, where the blocks shed per tier are counted (the
        exporters read them there); a planner of its own keeps them to itself."""
        self.tiers = tuple(tiers)
        self.manager = manager
        self.ledger = ledger
        self.block_bytes = block_bytes
        self.bound = config.writeback_max_bytes_in_flight
        self.num_workers = config.num_workers
        self.block_size_factor = config.block_size_factor
        self.policies = {tier.tier_name: tier.writeback for tier in config.lower_tiers}
        self.lookahead = {tier.tier_name: tier.evict_lookahead_blocks for tier in config.lower_tiers}
        self.stats = TierStats()
        self.connector_stats = connector_stats or ConnectorStats()
        self.queue_bounds = {tier.tier_name: tier.writeback_max_queued_blocks for tier in config.lower_tiers
                             if tier.writeback_max_queued_blocks is not None}
        self.gave_up_bound = manager.capacity * len(self.tiers)
        """How many (tier, key) pairs whose write-back failed are remembered: a key is a candidate only while its block
        is in the CPU pool, so a pool's worth per tier is all the rule needs; the oldest beyond it is tried again."""
        self._new_job_id = new_job_id
        self._created: list[TierJob] = []
        self._eager: dict[str, deque[int]] = {name: deque() for name, policy in self.policies.items()
                                              if policy == "eager"}
        """Each eager tier's stored keys not yet offered to it, oldest first: one queue per tier, so one tier's pick
        (which pins the slot `writing-back` for a while) hides the block from no other tier."""
        self._origin: dict[int, tuple[int, str]] = {}  # CPU slot -> (fetch job, tier) that filled it, until loaded
        self._stale: set[int] = set()  # write-backs in flight at a cache reset: their keys are dropped when they end
        self._gave_up: OrderedDict[tuple[str, int], None] = OrderedDict()  # (tier, key) whose write-back failed
        self._step = 0  # the step last planned: the one whose output reports the stores that end now
        self.room_lookups: deque[RoomLookup] = deque(maxlen=manager.capacity)
        """The latest lookups whose tier hit found no CPU slot to claim, and what each waited for: what
        `fetch-waits-for-room` reads (a pool's worth, as the invariants run every step)."""
        self._totals = self._total_rows()
        self._on_evict = tuple(tier for tier in self.tiers if self.policies[tier.name] == "on-evict")
        self._standing: tuple[tuple[int | None, ...], int] | None = None
        """What the last write-back plan read, if it ordered nothing: the pool's version and each on-evict tier's,
        and how many tiers it held back at the byte bound. While those are unchanged that plan stands
        (`_plan_stands`). The plan's other inputs move with the pool: the bytes in flight and the keys given up on
        change only as a write-back starts (pinning its slots) or ends (its slots moved by the spec's couplings);
        a reset forgets the plan."""

    # --- lookup ----------------------------------------------------------------------------------------------

    def fetch_missing(self, hashes: Sequence[int], cpu_hits: int, step: int) -> frozenset[int]:
        """Order fetches for the keys after the `cpu_hits` leading CPU hits of `hashes` that lower tiers publish;
        the fetch job ids (the request defers on them), or nothing when no tier holds the next key."""
        start, blockers = cpu_hits, []
        for tier in self.tiers:
            if start >= len(hashes):
                break
            count = tier.lookup(hashes[start:])
            if count == 0:
                continue
            job_id = self._new_job_id()
            plan = self.manager.prepare_fetch(hashes[:start + count], job_id)  # earlier keys stay protected
            if plan is None:
                busy = [slot for slot, block in enumerate(self.manager.blocks) if block.state in BUSY]
                waited = self._room_blockers(start + count, busy)
                self.room_lookups.append(RoomLookup(start + count, len(busy), waited))
                blockers.extend(waited)
                break
            if not plan.hashes:
                break
            job = self._new_job(job_id, "fetch", tier.name, plan.hashes, plan.slots, step)
            self.stats.hit_blocks[tier.name] += len(plan.hashes) * self.block_size_factor
            self._origin.update((slot, (job_id, tier.name)) for slot in plan.slots)
            blockers.append(job.job_id)
            start += count
        return frozenset(blockers)

    def _room_blockers(self, wanted: int, busy: Sequence[int]) -> frozenset[int]:
        """No CPU slot to claim for a fetch of the request's first `wanted` keys (`fetch-waits-for-room`): the jobs
        in flight on the pool's `busy` slots, on which the request defers, when the pool holds `wanted` keys once
        they end (each leaves its slots ready or free, evictable); none when it never can (a prefix longer than the
        pool), and the rest is computed. A hit below CPU that waits a few steps for room costs a few steps; one
        answered as a miss recomputes the whole prefix while the tier holds it."""
        if wanted > self.manager.capacity:
            return frozenset()
        blockers = self.ledger.blockers(busy)
        self.stats.room_waits += bool(blockers)
        return blockers

    def loaded(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        """A load of these CPU slots (`tokens[i]` tokens from slot i) was ordered: credit the tier a fetch brought each
        from, if the block the slot holds is still the one that fetch wrote (no store or fetch claimed it since)."""
        blocks = self.manager.blocks
        for slot, count in zip(slots, tokens):
            origin = self._origin.pop(slot, None)
            if origin is not None and blocks[slot].writer_job == origin[0]:
                self.stats.tokens_loaded_from[origin[1]] += count

    # --- write-back ------------------------------------------------------------------------------------------

    def stored(self, hashes: Sequence[int]) -> None:
        """These blocks' store completed: every eager tier writes them back, but for those its full queue sheds."""
        for name, queue in self._eager.items():
            room = self._queue_room(name, len(hashes))
            queue.extend(hashes[:room])
            if room < len(hashes):
                self._shed(name, hashes[room:])

    def _queue_room(self, tier: str, arriving: int) -> int:
        """How many of `arriving` stored blocks the tier's eager queue takes: all without a bound, else the room the
        blocks already queued leave."""
        bound = self.queue_bounds.get(tier)
        return arriving if bound is None else max(bound - len(self._eager[tier]), 0)

    def _shed(self, tier: str, keys: Sequence[int]) -> None:
        """Not written back to `tier`: a write-back job that ends shed as it is made, holding no CPU slot."""
        job = TierJob(job_id=self._new_job_id(), kind="write-back", tier=tier, keys=tuple(keys), cpu_slots=(),
                      block_bytes=self.block_bytes, ordered_step=self._step)
        self.ledger.add_tier_job(job)
        self.ledger.fire_tier_job(job, "shed")
        self.connector_stats.record_shed(tier, len(keys))

    def queues(self) -> dict[str, tuple[int, int | None]]:
        """Each eager tier's blocks waiting for their write-back, with its bound (None: unbounded), as
        `writeback-queue-bounded` reads them."""
        return {name: (len(queue), self.queue_bounds.get(name)) for name, queue in self._eager.items()}

    def _plan_write_backs(self, step: int) -> int:
        """Order this step's write-backs; how many tiers held candidates back at the byte bound."""
        held = 0
        budget = self.bound - sum(j.nbytes for j in self.ledger.tier_jobs.values()
                                  if j.kind == "write-back" and j.in_flight)
        room = budget // self.block_bytes
        blocks = self.manager.blocks
        for tier in self.tiers:
            queue = self._eager.get(tier.name)
            candidates = self._eager_candidates(queue) if queue is not None else self._next_victims(
                self.lookahead[tier.name])
            eligible = [s for s in candidates if blocks[s].state == Cpu.READY and not self._held_by(tier, s)
                        and (tier.name, blocks[s].block_hash) not in self._gave_up]
            picked, left = eligible[:max(room, 0)], eligible[max(room, 0):]
            if left:
                held += 1
                if queue is not None:
                    queue.extendleft(reversed([blocks[s].block_hash for s in left]))  # type: ignore[misc]
            if not picked:
                continue
            room -= len(picked)
            self.manager.pin_for_write_back(picked)
            self._new_job(self._new_job_id(), "write-back", tier.name,
                          tuple(blocks[s].block_hash for s in picked), tuple(picked), step)  # type: ignore[misc]
        self.stats.writebacks_held += held
        return held

    def _plan_stands(self) -> bool:
        """Whether the last write-back plan would be made again as it was (ordering nothing, holding back the same
        tiers, which are counted again): it ordered nothing, no eager tier has blocks queued, and neither the pool
        (its blocks' states, its eviction order) nor an on-evict tier's index changed since. An idle step then
        reads no victims; the plan is made again after any change (`manager.version`, `plan_version`)."""
        standing = self._standing
        if standing is None or any(self._eager.values()) or standing[0] != self._versions():
            return False
        self.stats.writebacks_held += standing[1]
        return True

    def _versions(self) -> tuple[int | None, ...]:
        return (self.manager.version, *(tier.plan_version for tier in self._on_evict))

    def _held_by(self, tier: LowerTier, slot: int) -> bool:
        """The tier holds the slot's key already (being written, published, or read)."""
        block_hash = self.manager.blocks[slot].block_hash
        assert block_hash is not None
        return tier.entries.get(block_hash) is not None or tier.lookup([block_hash]) > 0

    def _eager_candidates(self, queue: deque[int]) -> list[int]:
        """Slots of one eager tier's stored blocks not yet written back to it, oldest first; blocks evicted since are
        dropped, and blocks not readable now (another tier's write-back among them) stay queued for a later step."""
        slots: dict[int, None] = {}
        for _ in range(len(queue)):
            block_hash = queue.popleft()
            slot = self.manager.catalogue.get(block_hash)
            if slot is None or slot in slots:
                continue
            state = self.manager.blocks[slot].state
            if state == Cpu.READY:
                slots[slot] = None
            elif state in (Cpu.PENDING_STORE, Cpu.SUBMITTED, Cpu.LOADING, Cpu.WRITING_BACK):
                queue.append(block_hash)  # not readable for a write-back now: later
        return list(slots)

    def _next_victims(self, room: int) -> list[int]:
        """Up to `room` ready blocks in the order the CPU eviction policy would give them up."""
        blocks = self.manager.blocks
        n = room
        while n > 0:
            victims = self.manager.policy.victims(n, lambda s: blocks[s].state == Cpu.READY)
            if victims is not None:
                return victims
            n //= 2
        return []

    # --- the step's orders and their reports ----------------------------------------------------------------

    def orders(self, step: int) -> tuple[TierOrder, ...]:
        """Plan this step's write-backs, then hand every job created since the last step to the workers."""
        self._step = step
        if not self._plan_stands():
            before = len(self._created)
            held = self._plan_write_backs(step)
            versions = self._versions()
            ordered_none = len(self._created) == before and None not in versions
            self._standing = (versions, held) if ordered_none else None
        if not self._created:
            return ()
        created, self._created = self._created, []
        for job in created:
            self.ledger.fire_tier_job(job, "submit")
        return tuple(TierOrder.model_construct(job_id=j.job_id, kind=j.kind, tier=j.tier, keys=j.keys,
                                               cpu_slots=j.cpu_slots) for j in created)

    def report(self, worker: int, report: TierReport, step: int) -> None:
        """One worker's report of a tier job (`validation.check_reports` accepted it). The job ends once every worker
        reported it, failing the keys any of them failed; a job some worker reported `held` is abandoned instead,
        and released once each of those workers released it."""
        job = self.ledger.tier_jobs[report.job_id]
        if report.release:
            job.released.add(worker)
        else:
            job.reports[worker] = report
            outcome = self._outcome(job)
            if outcome is None:
                return
            if not outcome.held:
                self._finish(job, outcome.failed, step)
                return
            self._abandon(job, outcome.failed, step)
        if job.state == TierJobState.ABANDONED and not job.holding:
            self.ledger.fire_tier_job(job, "release")  # its slots are free: the spec's couplings free them
            self._ended(job)

    def _outcome(self, job: TierJob) -> TierOutcome | None:
        """The job's end over every rank once every rank reported it (a tensor-parallel control replaces this)."""
        return every_rank_tier_outcome(job, self.num_workers)

    def _abandon(self, job: TierJob, failed: dict[int, str], step: int) -> None:
        """Failed at the deadline, I/O still running: nobody waits for it (its slots leave the catalogue), but the
        slots stay held, orphaned, until its release."""
        job.failed_keys = job.keys
        self.ledger.fire_tier_job(job, "abandon", step=step)
        self.stats.failures.update(failed.values())
        if job.kind == "write-back":
            self._give_up(job.tier, job.keys)

    def _finish(self, job: TierJob, failed: dict[int, str], step: int) -> None:
        job.failed_keys = tuple(k for k in job.keys if k in failed)
        self.ledger.fire_tier_job(job, "fail" if failed else "complete", step=step)
        self.stats.failures.update(failed.values())
        if job.kind == "write-back":
            self.stats.blocks_written_back[job.tier] += len(job.keys) - len(failed)
            self._give_up(job.tier, failed)
        else:
            self.stats.blocks_fetched[job.tier] += len(job.keys) - len(failed)
        self._ended(job)

    def _ended(self, job: TierJob) -> None:
        """A write-back in flight at a cache reset ended (either way): what it wrote is from before the reset."""
        if job.job_id in self._stale:
            self._stale.discard(job.job_id)
            self._tier(job.tier).discard(job.keys)

    def _give_up(self, tier: str, keys: Sequence[int]) -> None:
        """Not written back to `tier` again (until a cache reset, or until `gave_up_bound` newer ones push it out)."""
        for key in keys:
            self._gave_up[(tier, key)] = None
        while len(self._gave_up) > self.gave_up_bound:
            self._gave_up.popitem(last=False)

    def reset(self) -> None:
        """A cache reset: drop what the lower tiers publish; keys of write-backs in flight are dropped when they end."""
        for tier in self.tiers:
            tier.discard([e.key for e in tier.entries if e.state == TierEntryState.PUBLISHED])
        self._stale = {j.job_id for j in self.ledger.tier_jobs.values() if j.kind == "write-back" and j.in_flight}
        for queue in self._eager.values():
            queue.clear()
        self._gave_up.clear()
        self._standing = None

    def totals(self) -> dict[str, int]:
        """The running totals `kvfsm.connector.metrics.counters` exports for these tiers, every tier and reason
        listed (0 until it counts)."""
        stats = self.stats
        return {key: getattr(stats, counter).get(label, 0) * scale for key, counter, label, scale in self._totals}

    def _total_rows(self) -> tuple[tuple[str, str, str, int], ...]:
        """Each running total `totals` lists: (its key, the `TierStats` counter, the label counted, a scale), named
        once at start-up (vLLM asks for the totals every step; naming each key anew was most of what that cost)."""
        names = [tier.name for tier in self.tiers]
        moved = {"write-back": "blocks_written_back", "fetch": "blocks_fetched"}
        return (tuple((tier_key(f"blocks.{d}", t), counter, t, 1) for d, counter in moved.items() for t in names)
                + tuple((tier_key(f"bytes.{d}", t), counter, t, self.block_bytes) for d, counter in moved.items()
                        for t in names)
                + tuple((tier_key("hit_blocks", t), "hit_blocks", t, 1) for t in names)
                + tuple((tier_key("loaded_tokens", t), "tokens_loaded_from", t, 1) for t in names)
                + tuple((tier_key("failures", r.value), "failures", r.value, 1) for r in TierFailure))

    @property
    def idle(self) -> bool:
        """Nothing in flight and no eager write-back waiting to be ordered."""
        return not any(self._eager.values()) and not any(j.in_flight for j in self.ledger.tier_jobs.values())

    # --- helpers ---------------------------------------------------------------------------------------------

    def _new_job(self, job_id: int, kind: str, tier: str, keys: Sequence[int], slots: Sequence[int],
                 step: int) -> TierJob:
        job = TierJob(job_id=job_id, kind=kind, tier=tier, keys=tuple(keys),  # type: ignore[arg-type]
                      cpu_slots=tuple(slots), block_bytes=self.block_bytes, ordered_step=step)
        self.ledger.add_tier_job(job)
        self._created.append(job)
        return job

    def _tier(self, name: str) -> LowerTier:
        return next(t for t in self.tiers if t.name == name)
