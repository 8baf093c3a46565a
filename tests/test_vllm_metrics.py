"""kvfsm's counters through vLLM's own stats hook and Prometheus metrics, under vLLM's real Scheduler.

The payloads are the ones vLLM's scheduler put in its `SchedulerStats` (what its loggers receive); they are
recorded by the class `KvfsmConnector.build_prom_metrics` returns, on a private registry. Skipped without vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry  # noqa: E402

from kvfsm.integrations.vllm import telemetry  # noqa: E402
from kvfsm.integrations.vllm.rig import FakeWorker  # noqa: E402
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
