"""kvfsm's counters as vLLM connector stats: what changed since vLLM last asked, summed across reports.

`KvfsmStats.data` holds three kinds of entries, told apart by their keys: a `ConnectorStats` counter's increase
(summed when vLLM aggregates intervals); `transfer_seconds.<direction>.counts` and `.sums`, the interval's jobs and
their summed time per histogram bucket (added bucket by bucket); and `pool.<state>`, CPU blocks per state (a
gauge: the latest report wins).

vLLM asks for stats every step, but counting the pool's states walks every CPU block (milliseconds for a pool of
tens of thousands), so the pool is sampled at most once per `POOL_SAMPLE_SECONDS` (vLLM logs every 10 s, Prometheus
scrapes every 15 s by default); and the totals are read only after a call that may have moved one (`StatsDelta.moved`:
an idle step's calls move none, and its request costs a clock read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvfsm.connector.stats import ConnectorStats

SECONDS = "transfer_seconds."
COUNTS, SUMS = ".counts", ".sums"
POOL = "pool."
POOL_SAMPLE_SECONDS = 10.0


@dataclass
class KvfsmStats(KVConnectorStats):
    """`data` maps counters to their increase over one interval, plus per-job times and the pool's states."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvfsmStats":
        for key, value in other.data.items():
            if key.startswith(POOL):
                self.data[key] = value
            elif key.startswith(SECONDS):
                mine = self.data.get(key)
                self.data[key] = list(value) if mine is None else [a + b for a, b in zip(mine, value)]
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's log line shows: counters and pool states as they are, each histogram as its job count."""
        reduced: dict[str, int | float] = {}
        for key, value in self.data.items():
            if key.endswith(COUNTS):
                reduced[key.removesuffix(COUNTS) + ".jobs"] = sum(value)
            elif not key.startswith(SECONDS):
                reduced[key] = value
        return reduced

    def is_empty(self) -> bool:
        return not any(value or key.startswith(POOL) for key, value in self.data.items())


class StatsDelta:
    """Turns kvfsm's running totals into per-interval increases, with the interval's job times and the pool."""

    def __init__(self, source: ConnectorStats, pool_usage: Callable[[], Mapping[str, int]],
                 tier_totals: Callable[[], Mapping[str, int]] = dict) -> None:
        """`tier_totals`: the lower tiers' running totals (`TierPlanner.totals`), counted like `source`'s."""
        self._source = source
        self._pool_usage = pool_usage
        self._tier_totals = tier_totals
        self._last = self._totals()
        self._last_times = {d: (list(h.counts), list(h.sums)) for d, h in source.transfer_times.items()}
        self._pool_sampled = float("-inf")
        self.moved = True
        """Set by the owner on every call that may move a counter (a lookup, an allocation, a step with requests,
        a step's reports); while it is unset the totals are those last taken, and `take` does not read them."""

    def _totals(self) -> dict[str, int | float]:
        return {**self._source.as_dict(), **self._tier_totals()}

    def take(self) -> KvfsmStats | None:
        clock = time.monotonic()
        sample = clock - self._pool_sampled >= POOL_SAMPLE_SECONDS
        if not (self.moved or sample):
            return None
        self.moved = False
        totals = self._totals()
        data: dict[str, Any] = {} if totals == self._last else {  # most steps move no counter: one compare in C
            key: value - self._last.get(key, 0) for key, value in totals.items()
            if value != self._last.get(key, 0)}  # a tier's first shed is a new key
        self._last = totals
        for direction, histogram in self._source.transfer_times.items():
            counts, sums = self._last_times[direction]
            if histogram.counts != counts:
                data[SECONDS + direction + COUNTS] = [a - b for a, b in zip(histogram.counts, counts)]
                data[SECONDS + direction + SUMS] = [a - b for a, b in zip(histogram.sums, sums)]
                self._last_times[direction] = (list(histogram.counts), list(histogram.sums))
        if sample:
            self._pool_sampled = clock
            data.update((POOL + state, count) for state, count in self._pool_usage().items())
        return KvfsmStats(data=data) if data else None
