"""The scheduler half's memory stays flat however long it runs (the 100k-request figure: `python -m kvfsm.testing.soak`)."""

from __future__ import annotations

from kvfsm.testing.soak import new_connector, soak

GROWTH_BOUND = 64 * 1024
"""Bytes the traced memory may grow after the warm-up: far below what one leaked record per request would cost."""


def test_a_long_run_keeps_memory_flat() -> None:
    connector = new_connector()
    result = soak(connector, requests=5_000, warmup=1_000)
    assert result.growth_bytes < GROWTH_BOUND, f"grew {result.growth_bytes:,} bytes over 4,000 requests"
    assert not connector.jobs and not connector.requests and not connector.reported_failed
    assert connector.stats.stores_failed and connector.stats.loads_failed, "the soak must take the failure paths"


def test_the_soak_catches_a_connector_that_keeps_what_it_is_done_with() -> None:
    """The control: a connector that keeps its history (every job and request) grows past the bound."""
    result = soak(new_connector(keep_history=True), requests=2_000, warmup=1_000)
    assert result.growth_bytes > GROWTH_BOUND


def test_without_history_a_connector_forgets_every_request_and_job_it_released() -> None:
    """The long run's end state in a short run (the soak itself is too slow to rerun per mutant)."""
    connector = new_connector()
    soak(connector, requests=60, warmup=10)
    assert not connector.jobs and not connector.requests and not connector.ledger.requests
