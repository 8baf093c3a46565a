"""kvfsm's metrics in vLLM's own Prometheus registry (`/metrics` of `vllm serve`), fed by vLLM's stats hook.

vLLM asks the scheduler-role connector for `get_kv_connector_stats()` every step and hands the intervals to the
class `build_prom_metrics` returned; this records them on metrics built with vLLM's metric classes (so Ray and
multiprocess deployments work as for vLLM's own), named and labelled as `kvfsm.connector.metrics` declares (the
lower tiers' counters labelled by the tier names the connector's `kv_connector_extra_config` gives).
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT

from kvfsm.connector.metrics import DIRECTIONS, POOL_BLOCKS, STORE_SHED, TRANSFER_SECONDS, counters
from kvfsm.integrations.vllm.config import offload_config
from kvfsm.integrations.vllm.telemetry import COUNTS, POOL, SECONDS, SUMS


class KvfsmPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = per_engine_labelvalues.items()
        self._counters: dict[tuple[int, str], Any] = {}
        for family in counters([tier.tier_name for tier in offload_config(vllm_config).lower_tiers]):
            counter = self._counter_cls(name=family.name, documentation=family.documentation,
                                        labelnames=labelnames + family.labelnames)
            for engine, values in engines:
                for labels, source in family.samples:
                    self._counters[(engine, source)] = counter.labels(
                        *values, *(labels[name] for name in family.labelnames))
        seconds = self._histogram_cls(name=TRANSFER_SECONDS.name, documentation=TRANSFER_SECONDS.documentation,
                                      buckets=TRANSFER_SECONDS.buckets, labelnames=labelnames + ["direction"])
        self._seconds = {(engine, SECONDS + d + COUNTS): seconds.labels(*values, d) for engine, values in engines
                         for d in DIRECTIONS}
        self._pool = self._gauge_cls(name=POOL_BLOCKS.name, documentation=POOL_BLOCKS.documentation,
                                     labelnames=labelnames + ["state"], multiprocess_mode="mostrecent")
        self._shed = self._counter_cls(name=STORE_SHED.name, documentation=STORE_SHED.documentation,
                                       labelnames=labelnames + ["tier"])
        self._engine_labels = dict(engines)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key.startswith(POOL):
                self._pool.labels(*self._engine_labels[engine_idx], key[len(POOL):]).set(value)
            elif key.endswith(COUNTS):
                # Each bucket's jobs observed at their mean time: same buckets, same count, same sum.
                histogram = self._seconds[(engine_idx, key)]
                sums = transfer_stats_data[key.removesuffix(COUNTS) + SUMS]
                for count, total in zip(value, sums):
                    for _ in range(count):
                        histogram.observe(total / count)
            elif (engine_idx, key) in self._counters:
                self._counters[(engine_idx, key)].inc(value)
            elif (tier := STORE_SHED.tier(key)) is not None:
                self._shed.labels(*self._engine_labels[engine_idx], tier).inc(value)
