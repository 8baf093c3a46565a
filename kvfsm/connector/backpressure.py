"""Back-pressure on GPU-to-CPU stores: when stores fall behind, the newest blocks are shed instead of queued.

A store ordered in step N is copied on the store stream from step N+1 and ends when every rank reported it. When the
copy engines fall behind (a step's stores outgrow PCIe, loads and stores of many requests share the link) the
stores in flight pile up: each holds CPU slots no lookup can hit yet, and the loads a request waits on queue behind
their copies. With `OffloadConfig.store_max_blocks_in_flight` the scheduler half orders a store's blocks only while
the CPU blocks of stores in flight stay within the bound; the rest are shed (`stores-bounded`): the request's
`skip-store` with reason `shed`, so no store of that request ever carries them (`skipped-not-stored`) and a later
lookup misses them and recomputes. A shed block is never half-published: it never gets a CPU slot.

Which blocks are shed: the last of the request's newly completed ones. A block's hash covers its whole prefix, so a
request's earlier blocks are the ones other requests can share; a later block stored after a shed one is reached by
a lookup only if someone else stores the gap, so shedding the tail keeps what the kept blocks are worth.

The count of blocks in flight is the ledger's (`Ledger.store_blocks_in_flight`), kept as jobs start and end. The
other queue that grows when stores fall behind, each eager lower tier's write-backs waiting, is bounded in
`kvfsm.connector.tier_planner` (`writeback-queue-bounded`).
"""

from __future__ import annotations

from typing import Container, Sequence

from kvfsm.connector.ledger import Ledger
from kvfsm.connector.stats import ConnectorStats
from kvfsm.records import RequestRecord

SHED = "shed"
"""The `skip-store` reason of a block back-pressure shed."""
CPU_TIER = "cpu"
"""The tier label of a GPU-to-CPU store shed (`kvfsm_store_shed_total{tier="cpu"}`)."""


class StoreBound:
    """The bound on the CPU blocks of stores in flight, and the shedding of blocks beyond it."""

    def __init__(self, bound: int | None, ledger: Ledger, stats: ConnectorStats) -> None:
        self.bound = bound
        self.ledger = ledger
        self.stats = stats

    def room(self) -> int:
        """CPU blocks a store may still take: the bound less the blocks of every store in flight."""
        assert self.bound is not None
        return self.bound - self.ledger.store_blocks_in_flight

    def admit(self, record: RequestRecord, admitted: Sequence[int], held: Container[int],
              readmitted: int = 0) -> Sequence[int]:
        """The blocks of `admitted` (in order) a store may carry now; those beyond the room left under the bound
        are shed for `record` (a block the pool already holds costs no store and is never shed). The first
        `readmitted` were admitted at an earlier offer of this request (it was preempted and recomputes): one beyond
        the room is not stored now but never shed, since a store of it from that offer may still be in flight and a
        skip is final for the request (`skipped-not-stored`)."""
        if self.bound is None:
            return admitted
        room = self.room()
        kept: list[int] = []
        shed: list[int] = []
        for index, block_hash in enumerate(admitted):
            if block_hash in held:
                kept.append(block_hash)
            elif room > 0:
                kept.append(block_hash)
                room -= 1
            elif index >= readmitted:
                shed.append(block_hash)
        if shed:
            self.ledger.fire_request(record, "skip-store", hashes=tuple(shed), reason=SHED)
            self.stats.record_shed(CPU_TIER, len(shed))
        return kept
