"""kvfsm's counters as vLLM connector stats: what changed since vLLM last asked, summed across reports."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvfsm.connector.stats import ConnectorStats


@dataclass
class KvfsmStats(KVConnectorStats):
    """`data` maps a `ConnectorStats` counter to its increase over one interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvfsmStats":
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsDelta:
    """Turns kvfsm's running totals into per-interval increases."""

    def __init__(self, source: ConnectorStats) -> None:
        self._source = source
        self._last = source.as_dict()

    def take(self) -> KvfsmStats | None:
        now = self._source.as_dict()
        delta = {key: value - self._last[key] for key, value in now.items() if value != self._last[key]}
        self._last = now
        return KvfsmStats(data=delta) if delta else None
