"""A looked-up request's CPU hit cut to where the engine's other KV-cache groups of the same request can load too.

An engine with several KV-cache groups (full attention beside sliding windows or state-space layers) has kvfsm track
each group of a request as a request of its own (`kvfsm.connector.tracked_ids`), looked up on its own. A prefix is
usable only where every group holds what it needs there (a window its whole window, a state its block ending there:
`state-at-prefix-end`), so between the lookups and the allocation the engine cuts every group's offer to one end.
These calls only shorten what a lookup recorded (`RequestRecord.match`) and the hit count: they fire no transition.

A base class of `SchedulerConnector`, as `LedgerTables` is, so that kvfsm.connector.scheduler keeps the lookup, the
orders and the completions within a module's line budget; it imports nothing of that module.
"""

from __future__ import annotations

from typing import Sequence

from kvfsm.connector.ledger_tables import LedgerTables
from kvfsm.connector.stats import ConnectorStats


class GroupOffers(LedgerTables):
    """Cuts of the CPU hits looked-up requests were offered."""

    stats: ConnectorStats

    def limit_match(self, request_id: str, end_block: int) -> None:
        """Offer the looked-up request's CPU hit only up to GPU block `end_block` (a group of a request with several
        KV-cache groups, cut where a shorter hit every group holds ends)."""
        record = self._get(request_id)
        if record.match is not None:
            first, count = record.match
            kept = max(0, min(count, end_block - first))
            self.stats.cpu_hit_blocks -= count - kept
            record.match = (first, kept)

    def match_together(self, request_id: str, partners: Sequence[str], end_block: int) -> bool:
        """Offer the looked-up request's CPU hit and its partners' (other KV-cache groups of one engine request) only
        up to GPU block `end_block`, and only if every partner's reaches it (a window needs its whole window there, a
        state its block ending there, `state-at-prefix-end`); else none of them (False)."""
        records = [self._get(request_id), *map(self._get, partners)]
        whole = all(sum(r.match or (0, 0)) >= end_block for r in records[1:])
        for record in records:
            self.limit_match(record.req_id, end_block if whole else 0)
        return whole
