"""The connector's counters are running totals: every job adds to them, none replaces what came before."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from kvfsm.connector.prometheus import KvfsmCollector
from kvfsm.connector.stats import TRANSFER_BUCKETS, ConnectorStats, TransferHistogram
from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import Harness
from test_connector_prometheus import offload_then_reload


def test_every_store_and_load_adds_to_the_totals() -> None:
    stats = ConnectorStats()
    for ok in (True, False, True, False):
        stats.record_store(2, ok, 100, 0.5)
        stats.record_load(3, ok, 10, 0.25)
    assert (stats.blocks_stored, stats.bytes_stored, stats.stores_failed, stats.store_seconds) == (4, 400, 2, 2.0)
    assert (stats.blocks_loaded, stats.bytes_loaded, stats.loads_failed, stats.load_seconds) == (6, 60, 2, 1.0)


def test_a_histogram_bucket_counts_and_sums_every_time_it_observes() -> None:
    histogram = TransferHistogram()
    histogram.observe(TRANSFER_BUCKETS[0])
    histogram.observe(TRANSFER_BUCKETS[0])
    assert (histogram.counts[0], histogram.sums[0]) == (2, 2 * TRANSFER_BUCKETS[0])


def test_a_jobs_time_in_flight_is_within_the_run_that_moved_it() -> None:
    h = Harness(SimDevice(), num_gpu_blocks=24, cpu_blocks=16)
    started = time.perf_counter()
    offload_then_reload(h)
    elapsed = time.perf_counter() - started
    stats = h.connector.scheduler.stats
    assert 0 < stats.store_seconds <= elapsed and 0 < stats.load_seconds <= elapsed
    h.close()


def test_every_exported_family_says_what_it_counts() -> None:
    h = Harness(SimDevice(), num_gpu_blocks=24, cpu_blocks=16)
    registry = CollectorRegistry()
    registry.register(KvfsmCollector.of(h.connector.scheduler))
    offload_then_reload(h)
    families = list(registry.collect())
    assert families and all(family.documentation for family in families), [f.name for f in families]
    h.close()
