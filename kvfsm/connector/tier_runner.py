"""The worker half's side of the lower tiers: hand the step's tier orders to the tiers, report what ended.

The worker owns the CPU pool's bytes, so it is where a write-back reads a slot and a fetch writes one: each order
becomes one `submit_write` / `submit_read` with zero-copy views of the slots (the scheduler pinned them
`writing-back` or claimed them `fetching`, so nothing else touches them until the report).
"""

from __future__ import annotations

from typing import Sequence

from kvfsm.connector.metadata import TierOrder, TierReport
from kvfsm.executor.pool import HostPool
from kvfsm.tiers.base import LowerTier


class UnknownTier(KeyError):
    """An order named a tier this worker did not open."""


class TierRunner:
    def __init__(self, tiers: Sequence[LowerTier], pool: HostPool) -> None:
        self.tiers = {tier.name: tier for tier in tiers}
        self._pool = pool

    def submit(self, orders: Sequence[TierOrder]) -> None:
        for order in orders:
            tier = self.tiers.get(order.tier)
            if tier is None:
                raise UnknownTier(f"tier order {order.job_id} names tier {order.tier!r}; open: {sorted(self.tiers)}")
            views = [memoryview(self._pool.slot(slot).numpy()) for slot in order.cpu_slots]
            if order.kind == "write-back":
                tier.submit_write(order.job_id, order.keys, views)
            else:
                tier.submit_read(order.job_id, order.keys, views)

    def poll(self) -> tuple[TierReport, ...]:
        return tuple(TierReport.model_construct(job_id=done.job_id,
                                                failed=tuple((k, r.value) for k, r in done.failed.items()),
                                                held=done.held, release=done.release)
                     for tier in self.tiers.values() for done in tier.poll())

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
