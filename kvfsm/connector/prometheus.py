"""kvfsm's metrics for any engine through prometheus_client (an optional dependency: `pip install prometheus_client`).

    from prometheus_client import REGISTRY, start_http_server
    REGISTRY.register(KvfsmCollector.of(connector.scheduler))
    start_http_server(9400)

The collector reads the scheduler half's running totals and transfer-time histograms at scrape time, so it keeps
nothing of its own and any number of collectors agree. Under vLLM use the adapter's hook instead (docs/vllm.md):
vLLM scrapes its own registry.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfsm.connector.metrics import DIRECTIONS, POOL_BLOCKS, STORE_SHED, TRANSFER_SECONDS, counters
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.connector.stats import ConnectorStats
from kvfsm.connector.tier_planner import TierPlanner


class KvfsmCollector(Collector):
    def __init__(self, stats: ConnectorStats, pool_usage: Callable[[], Mapping[str, int]],
                 tiers: TierPlanner | None = None) -> None:
        """`tiers`: the scheduler half's lower tiers, whose counters are exported beside the CPU pool's."""
        self._stats = stats
        self._pool_usage = pool_usage
        self._tiers = tiers
        self._counters = counters([tier.name for tier in tiers.tiers] if tiers is not None else ())

    @classmethod
    def of(cls, scheduler: SchedulerConnector) -> "KvfsmCollector":
        """The collector of one scheduler half: its stats, its host pool and its lower tiers."""
        return cls(scheduler.stats, scheduler.manager.usage, scheduler.tiers)

    def collect(self) -> Iterator[Metric]:
        totals = {**self._stats.as_dict(), **(self._tiers.totals() if self._tiers is not None else {})}
        for counter in self._counters:
            family = CounterMetricFamily(counter.name, counter.documentation, labels=counter.labelnames)
            for labels, source in counter.samples:
                family.add_metric([labels[name] for name in counter.labelnames], totals[source])
            yield family
        shed = CounterMetricFamily(STORE_SHED.name, STORE_SHED.documentation, labels=["tier"])
        for key, value in totals.items():
            tier = STORE_SHED.tier(key)
            if tier is not None:
                shed.add_metric([tier], value)
        yield shed
        yield self._transfer_seconds()
        pool = GaugeMetricFamily(POOL_BLOCKS.name, POOL_BLOCKS.documentation, labels=["state"])
        for state, count in self._pool_usage().items():
            pool.add_metric([state], count)
        yield pool

    def _transfer_seconds(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(TRANSFER_SECONDS.name, TRANSFER_SECONDS.documentation, labels=["direction"])
        bounds = [*map(str, TRANSFER_SECONDS.buckets), "+Inf"]
        for direction in DIRECTIONS:
            histogram = self._stats.transfer_times[direction]
            family.add_metric([direction], list(zip(bounds, accumulate(histogram.counts))), sum(histogram.sums))
        return family
