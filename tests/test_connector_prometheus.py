"""The prometheus_client collector: what a scrape shows equals the scheduler half's own counters and pool.

Runs kvfsm's reference engine on a `SimDevice` (stores, then a reload from CPU) and scrapes a private registry.
prometheus_client is optional for kvfsm but part of its test extra, so this runs in the main suite.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvfsm.connector.prometheus import KvfsmCollector
from kvfsm.connector.stats import TransferHistogram
from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import Harness

PREFIX = tuple(range(10, 28))


def offload_then_reload(h: Harness) -> None:
    h.add_request(PREFIX, 1)
    h.drain()
    h.engine.reset_prefix_cache()
    h.add_request(PREFIX + (5,), 1)
    h.drain()


@pytest.fixture
def scraped():
    h = Harness(SimDevice(), num_gpu_blocks=24, cpu_blocks=16)
    registry = CollectorRegistry()
    registry.register(KvfsmCollector.of(h.connector.scheduler))
    offload_then_reload(h)
    yield h, registry
    h.close()


def test_counters_are_the_scheduler_halfs_totals(scraped) -> None:
    h, registry = scraped
    stats = h.connector.scheduler.stats
    assert stats.blocks_stored and stats.blocks_loaded
    assert registry.get_sample_value("kvfsm_blocks_total", {"direction": "store"}) == stats.blocks_stored
    assert registry.get_sample_value("kvfsm_blocks_total", {"direction": "load"}) == stats.blocks_loaded
    assert registry.get_sample_value("kvfsm_bytes_total", {"direction": "load"}) == stats.bytes_loaded
    assert registry.get_sample_value("kvfsm_hit_blocks_total", {"tier": "cpu"}) == stats.cpu_hit_blocks
    assert registry.get_sample_value("kvfsm_lookups_total") == stats.lookups


def test_pool_gauge_counts_every_cpu_block_once(scraped) -> None:
    h, registry = scraped
    usage = h.connector.scheduler.manager.usage()
    shown = {state: registry.get_sample_value("kvfsm_pool_blocks", {"state": state}) for state in usage}
    assert shown == usage
    assert sum(shown.values()) == h.connector.scheduler.manager.capacity


def test_transfer_seconds_histogram_counts_each_completed_job_once_across_scrapes(scraped) -> None:
    h, registry = scraped
    stores = registry.get_sample_value("kvfsm_transfer_seconds_count", {"direction": "store"})
    loads = registry.get_sample_value("kvfsm_transfer_seconds_count", {"direction": "load"})
    assert (stores, loads) == (1, 1)
    assert registry.get_sample_value("kvfsm_transfer_seconds_count", {"direction": "store"}) == 1  # scraped again
    assert registry.get_sample_value("kvfsm_transfer_seconds_bucket", {"direction": "load", "le": "+Inf"}) == 1


def test_control_a_connector_that_records_no_times_shows_an_empty_histogram(monkeypatch) -> None:
    monkeypatch.setattr(TransferHistogram, "observe", lambda self, seconds: None)
    h = Harness(SimDevice(), num_gpu_blocks=24, cpu_blocks=16)
    registry = CollectorRegistry()
    registry.register(KvfsmCollector.of(h.connector.scheduler))
    offload_then_reload(h)
    assert h.connector.scheduler.stats.blocks_loaded
    assert registry.get_sample_value("kvfsm_transfer_seconds_count", {"direction": "load"}) == 0
    h.close()
