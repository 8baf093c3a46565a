"""The scheduler half's side of the lower tiers: lookup across tiers, fetches, and the write-back policy.

Lookup order: the CPU pool first, then each lower tier in configured order, each continuing where the one before
stopped. A hit found only below the CPU pool is not loaded from there: it is fetched into claimed CPU slots (state
`fetching`) and the request is *deferred* (the lookup answers None, as vLLM allows) until the fetch completed; its
next lookup then finds ready CPU blocks and loads them like any CPU hit. Deferring instead of making the load wait
on the fetch keeps the GPU load path unchanged (a load only ever reads ready CPU blocks) and costs no GPU blocks
while the disk works; it makes no convoy because a deferral names the fetch it waits for (the `no-convoy` check),
other requests keep being scheduled past it, and a request that needs the same keys meanwhile finds them fetching
and waits on the same fetch instead of starting a second one.

Write-back: each tier's `writeback` policy picks CPU blocks to copy down, `eager` (every stored block, soon after
its store completed) or `on-evict` (the blocks the CPU eviction policy will give up next); either way the blocks
are pinned `writing-back` until the write ended, and the bytes of write-backs in flight stay within
`OffloadConfig.writeback_max_bytes_in_flight` (a candidate that does not fit waits for a later step).
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import TierOrder, TierReport
from kvfsm.machines import MachineSet
from kvfsm.manager import OffloadingManager
from kvfsm.tiers.base import LowerTier
from kvfsm.records import TierJob
from kvfsm.states import CpuBlockState as Cpu
from kvfsm.states import TierEntryState, TierJobState


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


class TierPlanner:
    def __init__(self, config: OffloadConfig, tiers: Sequence[LowerTier], manager: OffloadingManager,
                 block_bytes: int, new_job_id: Callable[[], int], machines: MachineSet,
                 keep_history: bool = False) -> None:
        self.tiers = tuple(tiers)
        self.manager = manager
        self.block_bytes = block_bytes
        self.bound = config.writeback_max_bytes_in_flight
        self.num_workers = config.num_workers
        self.policies = {tier.tier_name: tier.writeback for tier in config.lower_tiers}
        self.lookahead = {tier.tier_name: tier.evict_lookahead_blocks for tier in config.lower_tiers}
        self.keep_history = keep_history
        self.stats = TierStats()
        self.jobs: dict[int, TierJob] = {}
        self.reported_failed: set[int] = set()
        self.slot_jobs: dict[int, int] = {}
        self._new_job_id = new_job_id
        self._machine = machines["tier-job"]
        self._created: list[TierJob] = []
        self._eager: deque[int] = deque()
        self._origin: dict[int, str] = {}  # hash -> tier a fetch brought it from, until loaded
        self._reports: dict[int, dict[int, TierReport]] = defaultdict(dict)
        self._holding: dict[int, set[int]] = {}  # abandoned job -> workers whose I/O for it may still run
        self._stale: set[int] = set()  # write-backs in flight at a cache reset: their keys are dropped when they end
        self._gave_up: set[tuple[str, int]] = set()  # (tier, key) whose write-back failed: not retried till reset

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
            if plan is None or not plan.hashes:
                break
            job = self._new_job(job_id, "fetch", tier.name, plan.hashes, plan.slots, step)
            self._origin.update((h, tier.name) for h in plan.hashes)
            blockers.append(job.job_id)
            start += count
        return frozenset(blockers)

    def blockers(self, slots: Sequence[int]) -> set[int]:
        """Tier jobs in flight on these CPU slots: what a request that met them busy waits for."""
        return {self.slot_jobs[s] for s in slots if s in self.slot_jobs}

    def loaded(self, hashes: Sequence[int], tokens: Sequence[int]) -> None:
        """A load of these CPU blocks (`tokens[i]` tokens from block i) was ordered: credit the tier each came from."""
        for block_hash, count in zip(hashes, tokens):
            origin = self._origin.pop(block_hash, None)
            if origin is not None:
                self.stats.tokens_loaded_from[origin] += count

    # --- write-back ------------------------------------------------------------------------------------------

    def stored(self, hashes: Sequence[int]) -> None:
        """These blocks' store completed: eager tiers write them back."""
        if "eager" in self.policies.values():
            self._eager.extend(hashes)

    def _plan_write_backs(self, step: int) -> None:
        budget = self.bound - sum(j.nbytes for j in self.jobs.values() if j.kind == "write-back" and j.in_flight)
        room = budget // self.block_bytes
        eager = self._eager_candidates() if "eager" in self.policies.values() else []
        blocks = self.manager.blocks
        for tier in self.tiers:
            eager_tier = self.policies[tier.name] == "eager"
            candidates = eager if eager_tier else self._next_victims(self.lookahead[tier.name])
            eligible = [s for s in candidates if blocks[s].state == Cpu.READY and not self._held_by(tier, s)
                        and (tier.name, blocks[s].block_hash) not in self._gave_up]
            picked, left = eligible[:max(room, 0)], eligible[max(room, 0):]
            if left:
                self.stats.writebacks_held += 1
                if eager_tier:
                    self._eager.extendleft(reversed([blocks[s].block_hash for s in left]))  # type: ignore[misc]
            if not picked:
                continue
            room -= len(picked)
            self.manager.pin_for_write_back(picked)
            self._new_job(self._new_job_id(), "write-back", tier.name,
                          tuple(blocks[s].block_hash for s in picked), tuple(picked), step)  # type: ignore[misc]

    def _held_by(self, tier: LowerTier, slot: int) -> bool:
        """The tier holds the slot's key already (being written, published, or read)."""
        block_hash = self.manager.blocks[slot].block_hash
        assert block_hash is not None
        return tier.entries.get(block_hash) is not None or tier.lookup([block_hash]) > 0

    def _eager_candidates(self) -> list[int]:
        """Slots of stored blocks not yet written back, oldest first; blocks evicted since are dropped."""
        slots: dict[int, None] = {}
        for _ in range(len(self._eager)):
            block_hash = self._eager.popleft()
            slot = self.manager.catalogue.get(block_hash)
            if slot is None or slot in slots:
                continue
            state = self.manager.blocks[slot].state
            if state == Cpu.READY:
                slots[slot] = None
            elif state in (Cpu.PENDING_STORE, Cpu.SUBMITTED, Cpu.LOADING, Cpu.WRITING_BACK):
                self._eager.append(block_hash)  # not readable for a write-back now: later
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
        self._plan_write_backs(step)
        created, self._created = self._created, []
        for job in created:
            self._machine.fire(job, "submit")
        return tuple(TierOrder.model_construct(job_id=j.job_id, kind=j.kind, tier=j.tier, keys=j.keys,
                                               cpu_slots=j.cpu_slots) for j in created)

    def report(self, worker: int, report: TierReport, step: int) -> None:
        """One worker's end of a tier job; the job ends when every worker reported it (failed keys unioned). A job
        some worker reported `held` is abandoned instead, and released once each of those workers released it."""
        job = self.jobs.get(report.job_id)
        if report.release:
            holding = self._holding.get(report.job_id, set())
            if job is None or worker not in holding:
                raise KeyError(f"worker {worker} released tier job {report.job_id}, which it does not hold")
            holding.discard(worker)
            if not holding:
                del self._holding[report.job_id]
                self._release(job)
            return
        if job is None or job.state != TierJobState.SUBMITTED or worker in self._reports.get(report.job_id, {}):
            raise KeyError(f"worker {worker} reported tier job {report.job_id}, which is not in flight for it")
        reports = self._reports[report.job_id]
        reports[worker] = report
        if len(reports) == self.num_workers:
            del self._reports[report.job_id]
            failed = dict(pair for r in reports.values() for pair in r.failed)
            held = {w for w, r in reports.items() if r.held}
            if held:
                self._holding[job.job_id] = held
                self._abandon(job, failed, step)
            else:
                self._finish(job, failed, step)

    def _abandon(self, job: TierJob, failed: dict[int, str], step: int) -> None:
        """Failed at the deadline, I/O still running: nobody waits for it (its slots leave the catalogue), but the
        slots stay held, orphaned, until its release."""
        job.failed_keys = job.keys
        self._machine.fire(job, "abandon", step=step)
        self.stats.failures.update(failed.values())
        self.reported_failed.add(job.job_id)
        if job.kind == "fetch":
            blocks = self.manager.blocks
            self.manager.abandon_fetch([s for s in job.cpu_slots if blocks[s].state == Cpu.FETCHING])
            for key in job.keys:
                self._origin.pop(key, None)
        else:
            blocks = self.manager.blocks
            self.manager.abandon_write_back([s for s in job.cpu_slots if blocks[s].state == Cpu.WRITING_BACK])
            self._gave_up.update((job.tier, key) for key in job.keys)

    def _release(self, job: TierJob) -> None:
        """The abandoned job's I/O returned: its orphaned slots are free."""
        self._machine.fire(job, "release")
        self._unmap(job)
        if job.kind == "fetch":
            self.manager.complete_fetch(job.cpu_slots, False)
        else:
            self.manager.complete_write_back(job.cpu_slots)
        if not self.keep_history:
            del self.jobs[job.job_id]

    def _finish(self, job: TierJob, failed: dict[int, str], step: int) -> None:
        job.failed_keys = tuple(k for k in job.keys if k in failed)
        self._machine.fire(job, "fail" if failed else "complete", step=step)
        self.stats.failures.update(failed.values())
        self._unmap(job)
        if failed:
            self.reported_failed.add(job.job_id)
        if job.kind == "write-back":
            self.manager.complete_write_back(job.cpu_slots)
            self.stats.blocks_written_back[job.tier] += len(job.keys) - len(failed)
            self._gave_up.update((job.tier, key) for key in failed)
            if job.job_id in self._stale:
                self._stale.discard(job.job_id)
                self._tier(job.tier).discard(job.keys)
        else:
            ok = [s for k, s in zip(job.keys, job.cpu_slots) if k not in failed]
            self.manager.complete_fetch(ok, True)
            self.manager.complete_fetch([s for k, s in zip(job.keys, job.cpu_slots) if k in failed], False)
            for key in failed:
                self._origin.pop(key, None)
            self.stats.blocks_fetched[job.tier] += len(ok)
        if not self.keep_history:
            del self.jobs[job.job_id]

    def reset(self) -> None:
        """A cache reset: drop what the lower tiers publish; keys of write-backs in flight are dropped when they end."""
        for tier in self.tiers:
            tier.discard([e.key for e in tier.entries if e.state == TierEntryState.PUBLISHED])
        self._stale = {j.job_id for j in self.jobs.values() if j.kind == "write-back" and j.in_flight}
        self._eager.clear()
        self._origin.clear()
        self._gave_up.clear()

    @property
    def idle(self) -> bool:
        """Nothing in flight and no eager write-back waiting to be ordered."""
        return not self._eager and not any(j.in_flight for j in self.jobs.values())

    # --- helpers ---------------------------------------------------------------------------------------------

    def _new_job(self, job_id: int, kind: str, tier: str, keys: Sequence[int], slots: Sequence[int],
                 step: int) -> TierJob:
        job = TierJob(job_id=job_id, kind=kind, tier=tier, keys=tuple(keys),  # type: ignore[arg-type]
                      cpu_slots=tuple(slots), block_bytes=self.block_bytes, ordered_step=step)
        self.jobs[job_id] = job
        self._created.append(job)
        for slot in job.cpu_slots:
            self.slot_jobs[slot] = job_id
        return job

    def _unmap(self, job: TierJob) -> None:
        for slot in job.cpu_slots:
            if self.slot_jobs.get(slot) == job.job_id:
                del self.slot_jobs[slot]

    def _tier(self, name: str) -> LowerTier:
        return next(t for t in self.tiers if t.name == name)
