"""The Mooncake tier under the reference engine, on a real master: prefixes shared between engines, keys isolated
between models, layouts and tenants, and every store fault ending as a miss or a failed fetch the engine
recomputes (outputs equal a run without offloading, nothing wrong loaded, nothing leaked)."""

from __future__ import annotations

import logging
import time
import uuid

import pytest

pytest.importorskip("mooncake.store")

from kvfsm.executor import SimDevice  # noqa: E402
from kvfsm.states import TierEntryState  # noqa: E402
from kvfsm.testing.harness import Harness  # noqa: E402
from kvfsm.testing.mooncake_store import unchecked_fetch  # noqa: E402

PROMPT = tuple(range(3, 3 + 16))
OTHER = tuple(range(500, 516))
STEP_BUDGET_S = 60.0


def engine(mooncake, cpu_blocks: int = 8, factor: int = 1, threads: bool = False, **options: object) -> Harness:
    return Harness(SimDevice(), num_gpu_blocks=12, cpu_blocks=cpu_blocks, block_size_factor=factor,
                   mooncake_master=str(mooncake.address), mooncake_options=options, tier_threads=threads)


def drive(harness: Harness) -> None:
    """Run to idle; with threaded tier I/O, let the engine keep stepping while the store works."""
    deadline = time.monotonic() + STEP_BUDGET_S
    while harness.engine.has_work or harness.connector.moving_between_tiers:
        assert time.monotonic() < deadline, "the engine did not drain"
        harness.engine.step()
        harness.settle()
        if harness.connector.moving_between_tiers:
            time.sleep(0.002)


def serve(harness: Harness, *prompts: tuple[int, ...]) -> None:
    for prompt in prompts:
        harness.add_request(prompt, max_new_tokens=3)
    drive(harness)


def from_store(harness: Harness) -> int:
    planner = harness.connector.scheduler.tiers
    return planner.stats.tokens_loaded_from["mooncake"] if planner is not None else 0


def failures(harness: Harness) -> dict[str, int]:
    planner = harness.connector.scheduler.tiers
    return dict(planner.stats.failures) if planner is not None else {}


def clean(harness: Harness) -> None:
    assert harness.final_violations() == []
    harness.close()


@pytest.fixture
def tenant() -> str:
    return uuid.uuid4().hex


def test_an_engine_loads_a_prefix_another_engine_stored(mooncake, tenant) -> None:
    a = engine(mooncake, tenant=tenant)
    serve(a, PROMPT)
    clean(a)
    b = engine(mooncake, tenant=tenant)
    serve(b, PROMPT)
    assert from_store(b) > 0, "the second engine recomputed what the first stored"
    assert ("tier-entry", "empty", "adopt", "published") in b.trace.edges
    clean(b)


def test_an_engine_does_not_write_back_a_block_another_engine_published(mooncake, tenant) -> None:
    b = engine(mooncake, tenant=tenant)
    b.add_request(PROMPT, max_new_tokens=3)
    b.engine.step()  # B's lookup misses: nothing is in the store yet, so B computes the prefix itself
    a = engine(mooncake, tenant=tenant)
    serve(a, PROMPT)  # meanwhile A computes the same prefix and publishes it
    published = {entry.key for entry in a.mooncake.entries}
    clean(a)
    drive(b)  # B stores the prefix in its CPU pool; its eager write-back finds the keys in the store
    assert from_store(b) == 0, "B loaded the prefix instead of computing it"
    assert published and {entry.key for entry in b.mooncake.entries} == published
    assert b.connector.scheduler.tiers.stats.blocks_written_back["mooncake"] == 0, "B wrote back A's blocks"
    clean(b)


@pytest.mark.parametrize("difference", ["model", "dtype", "tenant", "layout"])
def test_engines_that_differ_miss_each_others_keys(mooncake, tenant, difference: str) -> None:
    a = engine(mooncake, tenant=tenant)
    serve(a, PROMPT)
    clean(a)
    options: dict[str, object] = {"tenant": tenant}
    factor = 1
    if difference == "model":
        options["model_id"] = "another-model"
    elif difference == "dtype":
        options["kv_dtype"] = "float16"
    elif difference == "tenant":
        options["tenant"] = uuid.uuid4().hex
    else:
        factor = 2
    b = engine(mooncake, factor=factor, **options)
    serve(b, PROMPT)
    assert from_store(b) == 0
    clean(b)


def test_a_key_removed_between_lookup_and_fetch_is_a_miss(mooncake, tenant, caplog) -> None:
    a = engine(mooncake, tenant=tenant)
    serve(a, PROMPT)
    clean(a)
    b = engine(mooncake, tenant=tenant)
    b.add_request(PROMPT, max_new_tokens=3)
    b.engine.step()  # the lookup adopts the keys and orders a fetch; the fetch's call is still queued
    assert b.io.queue, "no fetch was ordered"
    store = b.mooncake.client.raw()
    for entry in b.mooncake.entries:
        assert store.remove(b.mooncake.store_key(entry.key), True) == 0
    with caplog.at_level(logging.WARNING):
        drive(b)
    assert failures(b).get("missing", 0) > 0 and "KeyMissing" in caplog.text
    assert from_store(b) == 0
    clean(b)


def _corrupted_fetch(mooncake, connect, tenant: str, mutant: bool) -> Harness:
    """Engine A stores a prefix; every value of it is corrupted in the store; engine B serves the prefix."""
    a = engine(mooncake, tenant=tenant)
    serve(a, PROMPT)
    hashes = [entry.key for entry in a.mooncake.entries]
    keys = [a.mooncake.store_key(block_hash) for block_hash in hashes]
    clean(a)
    store = connect(mooncake).raw()
    for key in keys:
        raw = bytearray(store.get(key))
        raw[0] ^= 0xFF
        assert store.remove(key, True) == 0 and store.put(key, bytes(raw)) == 0
    b = engine(mooncake, tenant=tenant)
    if mutant:
        unchecked_fetch(b.engine, b.connector)
    b.mooncake_faults.corrupted.update(hashes)
    b.add_request(PROMPT, max_new_tokens=3)
    drive(b)
    return b


def test_a_corrupted_value_fails_its_fetch_and_the_engine_recomputes(mooncake, connect, tenant, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        b = _corrupted_fetch(mooncake, connect, tenant, mutant=False)
    assert failures(b).get("corrupt", 0) > 0 and "ChecksumMismatch" in caplog.text
    assert from_store(b) == 0
    clean(b)


def test_control_without_the_value_check_a_corrupted_value_is_loaded_and_caught(mooncake, connect, tenant) -> None:
    b = _corrupted_fetch(mooncake, connect, tenant, mutant=True)
    found = b.final_violations()
    b.close()
    assert any(line.startswith(("ready-means-written", "output")) for line in found), found

def serve_only(harness: Harness, *prompts: tuple[int, ...]) -> None:
    """Submit and step until every request finished, without waiting for the tiers to go idle."""
    for prompt in prompts:
        harness.add_request(prompt, max_new_tokens=3)
    deadline = time.monotonic() + STEP_BUDGET_S
    while harness.engine.has_work:
        assert time.monotonic() < deadline, "the engine stopped serving"
        harness.engine.step()
        harness.settle()


THREADED = dict(op_timeout_s=0.5, lookup_timeout_s=0.05, retry_after_s=0.5)


def test_a_master_killed_mid_run_costs_misses_and_a_restarted_one_serves_again(fresh_mooncake, tenant,
                                                                              caplog) -> None:
    a = engine(fresh_mooncake, threads=True, tenant=tenant, **THREADED)
    serve(a, PROMPT)
    clean(a)
    b = engine(fresh_mooncake, threads=True, tenant=tenant, **THREADED)
    b.add_request(PROMPT, max_new_tokens=3)
    b.add_request(OTHER, max_new_tokens=3)
    with caplog.at_level(logging.WARNING):
        b.engine.step()
        fresh_mooncake.kill_master()
        drive(b)
        assert "StoreUnavailable" in caplog.text
        fresh_mooncake.restart_master()
        # The new master knows no object: what this engine published is gone from the store (a later fetch misses).
        b.mooncake_faults.removed.update(entry.key for entry in b.mooncake.entries)
        deadline = time.monotonic() + 30
        while b.mooncake.client.raw().put(f"probe-{tenant}", b"x") != 0:  # the segment host re-mounted
            assert time.monotonic() < deadline, "the store never served again after the restart"
            time.sleep(0.2)
        serve(b, tuple(range(900, 916)))
    assert b.final_violations() == []
    written = b.connector.scheduler.tiers.stats.blocks_written_back["mooncake"]
    b.close()
    assert written > 0, "nothing was written back after the restart"


def test_a_stalled_master_never_stops_the_engine_serving(fresh_mooncake, tenant, caplog) -> None:
    a = engine(fresh_mooncake, threads=True, tenant=tenant, **THREADED)
    serve(a, PROMPT)
    clean(a)
    b = engine(fresh_mooncake, threads=True, tenant=tenant, **THREADED)
    fresh_mooncake.pause_master()
    try:
        with caplog.at_level(logging.WARNING):
            serve_only(b, PROMPT, OTHER)
        assert not b.engine.has_work, "requests finished while the store was stalled"
    finally:
        fresh_mooncake.resume_master()
    drive(b)
    assert from_store(b) == 0
    clean(b)


def test_a_full_store_fails_write_backs_and_the_engine_serves_on(fresh_mooncake, connect, tenant) -> None:
    from mooncake.store import ReplicateConfig

    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    hog = connect(fresh_mooncake).raw()
    codes = [hog.put(f"hog-{i}", bytes(4 << 20), pinned) for i in range(32)]
    small = [hog.put(f"hog-small-{i}", bytes(64 << 10), pinned) for i in range(64)]
    assert any(code != 0 for code in codes + small), "the store never filled"
    b = engine(fresh_mooncake, tenant=tenant)
    serve(b, PROMPT, OTHER)
    assert failures(b).get("full", 0) > 0
    clean(b)


def test_a_value_of_another_length_under_a_published_key_holds_no_stored_bytes(mooncake, tenant) -> None:
    """The harness compares each published key's stored bytes with its prefix's: a value cut short (or grown) is
    no block's bytes, whatever its first bytes say."""
    harness = engine(mooncake, tenant=tenant)
    try:
        serve(harness, PROMPT)
        tier = harness.mooncake
        assert tier is not None
        key = next(e.key for e in tier.entries if e.state == TierEntryState.PUBLISHED)
        store, name = tier.client.raw(), tier.store_key(key)
        raw = bytes(store.get(name))
        assert tier.stored_bytes(key) == raw[:tier.block_bytes]
        store.remove(name, True)
        store.put(name, raw[:-1])
        assert tier.stored_bytes(key) is None
    finally:
        harness.close()
