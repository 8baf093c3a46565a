"""The worker half's side of the lower tiers: hand the step's tier orders to the tiers, report what ended.

The worker owns the CPU pool's bytes, so it is where a write-back reads a slot and a fetch writes one: each order
becomes one `submit_write` / `submit_read` with zero-copy views of the slots (the scheduler pinned them
`writing-back` or claimed them `fetching`, so nothing else touches them until the report).

With block checksums on, the checksum travels with the block: a write-back hands the tier the checksum its slot's
block was first stored with, and a fetch's completion hands back the one stored with the key, which the slot's
next load is checked against (`kvfsm.connector.checksums`).
"""

from __future__ import annotations

from typing import Sequence

from kvfsm.connector.checksums import SlotChecksums
from kvfsm.connector.metadata import TierOrder, TierReport
from kvfsm.executor.pool import HostPool
from kvfsm.tiers.base import LowerTier, TierCompletion


class UnknownTier(KeyError):
    """An order named a tier this worker did not open."""


class TierRunner:
    def __init__(self, tiers: Sequence[LowerTier], pool: HostPool, checksums: SlotChecksums | None = None) -> None:
        self.tiers = {tier.name: tier for tier in tiers}
        self._pool = pool
        self._checksums = checksums
        self._fetching: dict[int, dict[int, int]] = {}
        """With checksums: each fetch in flight, key -> the CPU slot it fills, until its completion."""

    def submit(self, orders: Sequence[TierOrder]) -> None:
        for order in orders:
            tier = self.tiers.get(order.tier)
            if tier is None:
                raise UnknownTier(f"tier order {order.job_id} names tier {order.tier!r}; open: {sorted(self.tiers)}")
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
        reports = []
        for tier in self.tiers.values():
            for done in tier.poll():
                self._carry(done)
                reports.append(TierReport.model_construct(
                    job_id=done.job_id, failed=tuple((k, r.value) for k, r in done.failed.items()),
                    held=done.held, release=done.release))
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
