"""The Mooncake tier's local index is bounded: it remembers at most `index_keys` published keys (a shared store may
hold far more than one engine needs again), forgets the least recently used first, and a lookup that meets a
forgotten key adopts it again from the store, head of the prefix kept longest."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("mooncake.store")

from test_mooncake_tier import OTHER, PROMPT, clean, engine, from_store, serve  # noqa: E402

BOUND = 4
"""Fewer keys than one prompt's blocks: every prompt served overflows the index."""


@pytest.fixture
def bounded(mooncake):  # type: ignore[no-untyped-def]
    harness = engine(mooncake, tenant=uuid.uuid4().hex, index_keys=BOUND)
    yield harness
    clean(harness)


def test_the_tier_remembers_at_most_index_keys_published_keys(bounded) -> None:
    serve(bounded, PROMPT, OTHER)
    assert bounded.connector.scheduler.tiers.stats.blocks_written_back["mooncake"] > BOUND
    assert len(bounded.mooncake.entries) <= BOUND
    assert ("tier-entry", "published", "evict", "empty") in bounded.trace.edges


def test_a_prefix_the_tier_forgot_is_adopted_again_from_the_store_head_first(bounded) -> None:
    """Each lookup adopts the prefix's next keys, the head kept over the tail, so a prefix longer than the index
    still comes whole from the store, `index_keys` blocks per fetch."""
    serve(bounded, PROMPT)
    serve(bounded, OTHER)  # PROMPT's keys are forgotten here, and leave the CPU pool; the store keeps them
    bounded.engine.reset_prefix_cache()
    serve(bounded, PROMPT)
    assert ("tier-entry", "empty", "adopt", "published") in bounded.trace.edges
    assert bounded.connector.scheduler.tiers.stats.blocks_fetched["mooncake"] == len(PROMPT) // 2 - 1
