"""kvfsm's counters as vLLM connector stats: what changed since vLLM last asked, summed across reports.

`KvfsmStats.data` holds three kinds of entries, told apart by their keys: a `ConnectorStats` counter's increase
(summed when vLLM aggregates intervals), `transfer_seconds.<direction>` per-job times (concatenated), and
`pool.<state>` CPU blocks per state (a gauge: the latest report wins).

vLLM asks for stats every step, but counting the pool's states walks every CPU block, so the pool is sampled at
most once per `POOL_SAMPLE_SECONDS` (Prometheus scrapes every 15 s by default).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvfsm.connector.stats import ConnectorStats

SECONDS = "transfer_seconds."
POOL = "pool."
POOL_SAMPLE_SECONDS = 1.0


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
                self.data[key] = [*self.data.get(key, ()), *value]
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's log line shows: counters and pool states as they are, per-job times as count and mean."""
        reduced: dict[str, int | float] = {}
        for key, value in self.data.items():
            if key.startswith(SECONDS):
                reduced[f"{key}.count"] = len(value)
                reduced[f"{key}.mean"] = sum(value) / len(value) if value else 0.0
            else:
                reduced[key] = value
        return reduced

    def is_empty(self) -> bool:
        return not any(value or key.startswith(POOL) for key, value in self.data.items())


class StatsDelta:
    """Turns kvfsm's running totals into per-interval increases, with the interval's job times and the pool."""

    def __init__(self, source: ConnectorStats, pool_usage: Callable[[], Mapping[str, int]]) -> None:
        self._source = source
        self._pool_usage = pool_usage
        self._last = source.as_dict()
        self._pool_sampled = float("-inf")

    def take(self) -> KvfsmStats | None:
        totals = self._source.as_dict()
        data: dict[str, Any] = {key: value - self._last[key] for key, value in totals.items()
                                if value != self._last[key]}
        self._last = totals
        data.update((SECONDS + direction, times) for direction, times in self._source.take_seconds().items()
                    if times)
        clock = time.monotonic()
        if clock - self._pool_sampled >= POOL_SAMPLE_SECONDS:
            self._pool_sampled = clock
            data.update((POOL + state, count) for state, count in self._pool_usage().items())
        return KvfsmStats(data=data) if data else None
