"""kvfsm's counters through vLLM's own stats hook and Prometheus metrics, under vLLM's real Scheduler.

The payloads are the ones vLLM's scheduler put in its `SchedulerStats` (what its loggers receive); they are
recorded by the class `KvfsmConnector.build_prom_metrics` returns, on a private registry. Skipped without vLLM.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvfsm.connector.metrics import TRANSFER_SECONDS  # noqa: E402
from kvfsm.connector.stats import ConnectorStats, TransferHistogram  # noqa: E402

from kvfsm.integrations.vllm import KvfsmConnector, telemetry  # noqa: E402
from kvfsm.integrations.vllm.rig import FakeWorker  # noqa: E402
from kvfsm.integrations.vllm.telemetry import COUNTS, POOL, SECONDS, SUMS, KvfsmStats, StatsDelta  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, make_driver, model, scraped, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm


def scraped_after_a_reload(d: Driver) -> CollectorRegistry:
    store_prefix(d)
    d.add("reader", PREFIX + [1, 2, 3])
    d.run()
    return scraped(d)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})


def test_vllm_metrics_equal_the_scheduler_halfs_totals(make_driver) -> None:
    d = make_driver(FakeWorker(load_steps=2))
    registry = scraped_after_a_reload(d)
    stats = d.connector.scheduler_side.kvfsm.stats
    assert stats.blocks_loaded == 4
    assert sample(registry, "kvfsm_blocks_total", direction="load") == stats.blocks_loaded
    assert sample(registry, "kvfsm_blocks_total", direction="store") == stats.blocks_stored
    assert sample(registry, "kvfsm_bytes_total", direction="store") == stats.bytes_stored
    assert sample(registry, "kvfsm_hit_blocks_total", tier="cpu") == stats.cpu_hit_blocks
    assert sample(registry, "kvfsm_lookups_total") == stats.lookups
    assert sample(registry, "kvfsm_failed_jobs_total", direction="load") == 0


def test_vllm_histogram_has_one_observation_per_completed_job(make_driver) -> None:
    d = make_driver(FakeWorker(load_steps=2))
    registry = scraped_after_a_reload(d)
    for direction in ("store", "load"):
        completed = sum(job.kind == direction for job in d.worker.finished)
        assert completed == 1
        assert sample(registry, "kvfsm_transfer_seconds_count", direction=direction) == completed


def test_vllm_pool_gauge_shows_every_cpu_block_in_its_state(make_driver, monkeypatch) -> None:
    monkeypatch.setattr(telemetry, "POOL_SAMPLE_SECONDS", 0.0)  # a sample every step, so the last one is current
    d = make_driver(FakeWorker(load_steps=2))
    registry = scraped_after_a_reload(d)
    manager = d.connector.scheduler_side.kvfsm.manager
    shown = {state: sample(registry, "kvfsm_pool_blocks", state=state) for state in manager.usage()}
    assert shown == manager.usage()
    assert shown["ready"] > 0


def test_control_payloads_lost_between_scheduler_and_logger_show_as_missing_loads(make_driver) -> None:
    d = make_driver(FakeWorker(load_steps=2))
    d.connector.scheduler_side.stats.take = lambda: None  # the hook reports nothing
    registry = scraped_after_a_reload(d)
    assert sample(registry, "kvfsm_blocks_total", direction="load") == 0
    assert d.connector.scheduler_side.kvfsm.stats.blocks_loaded == 4


# --- the stats payload itself ------------------------------------------------------------------------------------

LOAD_COUNTS, LOAD_SUMS = SECONDS + "load" + COUNTS, SECONDS + "load" + SUMS


def test_intervals_aggregate_counters_summed_job_times_by_bucket_and_the_pool_latest() -> None:
    first = KvfsmStats(data={"lookups": 2, LOAD_COUNTS: [1, 0], LOAD_SUMS: [0.5, 0.0], POOL + "free": 3})
    second = {"lookups": 3, "deferrals": 1, LOAD_COUNTS: [2, 1], LOAD_SUMS: [0.25, 1.0], POOL + "free": 5}
    assert first.aggregate(KvfsmStats(data=second)) is first
    assert first.data == {"lookups": 5, "deferrals": 1, LOAD_COUNTS: [3, 1], LOAD_SUMS: [0.75, 1.0],
                          POOL + "free": 5}
    assert KvfsmStats().aggregate(KvfsmStats(data=second)).data == second


def test_the_log_line_shows_counters_and_the_pool_as_they_are_and_each_histogram_as_its_jobs() -> None:
    stats = KvfsmStats(data={"lookups": 5, LOAD_COUNTS: [3, 1], LOAD_SUMS: [0.75, 1.0], POOL + "free": 5})
    assert stats.reduce() == {"lookups": 5, SECONDS + "load.jobs": 4, POOL + "free": 5}


def test_stats_of_zero_counters_are_empty_and_a_pool_state_or_a_count_is_not() -> None:
    assert KvfsmStats(data={"lookups": 0}).is_empty()
    assert not KvfsmStats(data={"lookups": 0, POOL + "free": 0}).is_empty()
    stats = KvfsmStats(data={"lookups": 1})
    assert not stats.is_empty()
    stats.reset()
    assert stats.data == {} and stats.is_empty()


def test_vllm_rebuilds_the_stats_it_was_sent_from_their_data() -> None:
    assert KvfsmConnector.build_kv_connector_stats({"lookups": 2}).data == {"lookups": 2}
    assert KvfsmConnector.build_kv_connector_stats().data == {}


def test_each_interval_reports_only_what_moved_and_the_pool_every_ten_seconds(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(telemetry, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    source, tiers = ConnectorStats(), {}
    delta = StatsDelta(source, lambda: {"free": 4}, lambda: dict(tiers))
    one_load = TransferHistogram()
    one_load.observe(0.01)
    loads = {LOAD_COUNTS: one_load.counts, LOAD_SUMS: one_load.sums}

    def interval(at: float) -> dict | None:
        clock[0], delta.moved = at, True
        taken = delta.take()
        return None if taken is None else taken.data

    source.lookups = 2
    source.record_load(1, True, 8, 0.01)
    assert interval(100.0) == {"lookups": 2, "blocks_loaded": 1, "bytes_loaded": 8, "load_seconds": 0.01, **loads,
                               POOL + "free": 4}
    source.cpu_hit_blocks = 3
    source.record_load(1, True, 8, 0.01)
    assert interval(105.0) == {"cpu_hit_blocks": 3, "blocks_loaded": 1, "bytes_loaded": 8, "load_seconds": 0.01,
                               **loads}
    tiers["disk.shed"] = 1  # a key first seen at 1
    assert interval(106.0) == {"disk.shed": 1}
    tiers["disk.failed"] = 0  # a key first seen at 0 moved nothing
    assert interval(107.0) is None
    assert interval(110.0) == {POOL + "free": 4}  # ten seconds after the last sample


def fresh_metrics(d: Driver) -> tuple[CollectorRegistry, Any]:
    """kvfsm's vLLM metrics on a private registry, before any payload."""
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    return registry, KvfsmConnector.build_prom_metrics(d.scheduler.vllm_config, types, ["model_name", "engine"],
                                                       {0: ["tiny", "0"]})


def test_every_kvfsm_metric_has_its_help_text_and_the_job_times_their_own_buckets(make_driver) -> None:
    registry, _ = fresh_metrics(make_driver(FakeWorker()))
    families = [family for family in registry.collect() if family.name.startswith("kvfsm")]
    assert families and all(isinstance(family.documentation, str) and family.documentation for family in families)
    (times,) = [family for family in families if family.name == TRANSFER_SECONDS.name]
    bounds = [float(sample.labels["le"]) for sample in times.samples
              if sample.name.endswith("_bucket") and sample.labels["direction"] == "load"]
    assert bounds == [*TRANSFER_SECONDS.buckets, float("inf")]


def test_a_bucket_of_several_jobs_is_observed_at_their_mean_time(make_driver) -> None:
    registry, metrics = fresh_metrics(make_driver(FakeWorker()))
    metrics.observe({LOAD_COUNTS: [0, 2], LOAD_SUMS: [0.0, 0.006]}, 0)
    labels = {"model_name": "tiny", "engine": "0", "direction": "load"}
    assert registry.get_sample_value(TRANSFER_SECONDS.name + "_count", labels) == 2
    assert registry.get_sample_value(TRANSFER_SECONDS.name + "_sum", labels) == pytest.approx(0.006)

