"""The worker half's side of the lower tiers: hand the step's tier orders to the tiers, report what ended.

The worker owns the CPU pool's bytes, so it is where a write-back reads a slot and a fetch writes one: each order
becomes one `submit_write` / `submit_read` with zero-copy views of the slots (the scheduler pinned them
`writing-back` or claimed them `fetching`, so nothing else touches them until the report).

With block checksums on, the checksum travels with the block: a write-back hands the tier the checksum its slot's
block was first stored with, and a fetch's completion hands back the one stored with the key, which the slot's
next load is checked against (`kvfsm.connector.checksums`).

With replicated KV (the ranks of a host share one pool) one rank moves each tier job's bytes between the shared slots
and the tier, and every other rank opens no tier: its runner reports each order at its next poll with nothing moved
(spec: `replicated-one-tier-move`). A write-back's block is then written once, and a fetch lands in the shared slot
once; the scheduler still ends the job only on every rank's report, the mover's included (`tier-job-every-rank`), so
no rank loads a fetched slot before the mover's read landed.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvfsm.connector.checksums import SlotChecksums
from kvfsm.connector.metadata import TierOrder, TierReport
from kvfsm.executor.pool import HostPool
from kvfsm.tiers.base import LowerTier, TierCompletion


class UnknownTier(KeyError):
    """An order named a tier this worker did not open."""


class TierRunner:
    def __init__(self, tiers: Sequence[LowerTier], pool: HostPool, checksums: SlotChecksums | None = None,
                 names: Sequence[str] | None = None, moves: Callable[[int], bool] = lambda job_id: True) -> None:
        """`names`: the configured tiers' names (default: those of `tiers`); `moves`: whether this rank moves the
        bytes of a job id (with replicated KV only `REPLICATED_TIER_RANK` does, and the others open no tier)."""
        self.tiers = {tier.name: tier for tier in tiers}
        self.names = frozenset(self.tiers if names is None else names)
        self.moves = moves
        self._pool = pool
        self._checksums = checksums
        self._fetching: dict[int, dict[int, int]] = {}
        """With checksums: each fetch in flight, key -> the CPU slot it fills, until its completion."""
        self._unmoved: list[int] = []
        """Jobs another rank moves, reported at the next poll."""

    def submit(self, orders: Sequence[TierOrder]) -> None:
        for order in orders:
            if order.tier not in self.names:
                raise UnknownTier(f"tier order {order.job_id} names tier {order.tier!r}; open: {sorted(self.names)}")
            if not self.moves(order.job_id):
                self._unmoved.append(order.job_id)
                continue
            tier = self.tiers[order.tier]
            views = [memoryview(self._pool.slot(slot).numpy()) for slot in order.cpu_slots]
            if order.kind == "write-back":
                sums = self._checksums.of(order.cpu_slots) if self._checksums is not None else ()
                tier.submit_write(order.job_id, order.keys, views, sums)
                continue
            if self._checksums is not None:
                self._checksums.forget(order.cpu_slots)
                self._fetching[order.job_id] = dict(zip(order.keys, order.cpu_slots))
            tier.submit_read(order.job_id, order.keys, views)

    def poll(self) -> tuple[TierReport, ...]:
        reports = [TierReport.model_construct(job_id=job_id, failed=(), held=False, release=False, moved=False)
                   for job_id in self._unmoved]
        self._unmoved = []
        for tier in self.tiers.values():
            for done in tier.poll():
                self._carry(done)
                reports.append(TierReport.model_construct(
                    job_id=done.job_id, failed=tuple((k, r.value) for k, r in done.failed.items()),
                    held=done.held, release=done.release, moved=True))
        return tuple(reports)

    def _carry(self, done: TierCompletion) -> None:
        """A fetch ended: each slot it filled takes the checksum its block came with (before the scheduler hears
        of it, so before any load of it is ordered)."""
        slots = self._fetching.pop(done.job_id, None)
        if slots is None or self._checksums is None or done.release:
            return
        for key, slot in slots.items():
            if key not in done.failed:
                self._checksums.carry(slot, done.checksums.get(key))

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
