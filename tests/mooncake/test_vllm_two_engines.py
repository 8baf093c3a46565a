"""Two vLLM engines in two processes share a prefix through one real `mooncake_master`: engine A (a process of its
own, `vllm_engines.EngineA`) writes a prompt back and stays up; engine B, the test's, started afterwards, serves its
first request for that prefix Mooncake -> CPU -> GPU, with exactly A's bytes and none of it computed. Another
tenant, by kvfsm's `tenant` or by vLLM's `cache_salt`, misses it: no fetch is even ordered. Both engines run vLLM's
real Scheduler and the adapter's real worker role, traced and checked after every step and drained (A's checks run
in A: a violation there fails the test with A's traceback). Each rule has a control that breaks it and is caught.
Skipped when vLLM or Mooncake is not installed.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")

import vllm.v1.core.kv_cache_utils as kv_cache_utils  # noqa: E402

import kvfsm.integrations.vllm.master_lookup as master_lookup  # noqa: E402
import kvfsm.tiers.mooncake as mooncake_tier_module  # noqa: E402
from kvfsm.integrations.vllm.rig import vllm_config  # noqa: E402
from kvfsm.mooncake.keys import object_key  # noqa: E402
from kvfsm.mooncake.local import LocalMooncake  # noqa: E402
from test_vllm_mooncake_tier import mooncake_tier  # noqa: E402
from test_vllm_tiers import MAX_STEPS, PREFIX, fetches, misplace_fetches, tiered  # noqa: E402
from vllm_engines import Control, EngineA, Zygote, blocks_bytes  # noqa: E402
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import model  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm


@pytest.fixture
def engine_a(model) -> Iterator[Callable[..., EngineA]]:
    """`engine_a(tier, cache_salt=None, controls=())`: engine A over `tier` in a process of its own (forked by the
    module's zygote), writing PREFIX back; killed at the test's end if still up."""
    started: list[EngineA] = []

    def start(tier: dict[str, Any], cache_salt: str | None = None, controls: tuple[Control, ...] = ()) -> EngineA:
        started.append(ZYGOTE.engine_a(model.model, tier, PREFIX + [1, 2, 3], cache_salt, controls))
        return started[-1]

    yield start
    for engine in started:
        engine.close()


def served_in_b(tiered, engine_a, writer: dict[str, Any], reader: dict[str, Any], writer_salt: str | None = None,
                reader_salt: str | None = None, controls: tuple[Control, ...] = ()
                ) -> tuple[bytes, Driver, AdapterWorker]:
    """A (its own process, `writer` tier) writes PREFIX back and stays up; B (`reader` tier), started afterwards,
    steps once (its worker tells its scheduler its key namespace) and serves a reader of PREFIX. `controls` apply in
    A (the caller applies them in B). (A's prefix bytes, B's driver, B's worker); A is still up."""
    a = engine_a(writer, writer_salt, controls)
    written = a.written()
    b, (worker,) = tiered(reader)
    b.step()
    b.add("reader", PREFIX + [9], cache_salt=reader_salt)
    b.run(MAX_STEPS)
    assert a.alive(), "engine A is gone: B was not served by a live engine's peer"
    return written, b, worker


def reader_loads(b: Driver) -> list[Any]:
    return [o for log in b.log for o in log.orders.loads if o.req_id == "reader"]


def missed(b: Driver) -> bool:
    """B neither fetched nor loaded anything for the reader, and computed it."""
    return not fetches(b) and not reader_loads(b) and "reader" in b.first_token


# --- B is served A's prefix -------------------------------------------------------------------------------------


def bytes_served_to_b(tiered, engine_a, tier: dict[str, Any]) -> tuple[bytes, bytes, Driver]:
    """(A's prefix bytes, what B's GPU holds where B loaded the prefix, B's driver)."""
    written, b, worker = served_in_b(tiered, engine_a, tier, tier)
    (load,) = reader_loads(b)
    return written, blocks_bytes(worker, list(load.gpu_blocks)), b


def test_engine_b_is_served_from_mooncake_exactly_the_bytes_engine_a_wrote_back_in_another_process(
        tiered, engine_a, mooncake: LocalMooncake) -> None:
    written, served, b = bytes_served_to_b(tiered, engine_a, mooncake_tier(mooncake, "tiny-two-processes"))
    assert served == written
    assert [log.first_computed["reader"] for log in b.log if "reader" in log.first_computed] == [len(PREFIX)], \
        "B computed some of the prefix itself"
    stats = b.connector.scheduler_side.kvfsm.tiers.stats
    assert stats.tokens_loaded_from["mooncake"] == len(PREFIX) and stats.blocks_written_back["mooncake"] == 0
    assert b.cpu_pool_drained()


def test_control_a_fetch_that_lands_in_the_wrong_cpu_slots_serves_b_bytes_other_than_as(
        tiered, engine_a, mooncake: LocalMooncake, monkeypatch: pytest.MonkeyPatch) -> None:
    misplace_fetches(monkeypatch)
    written, served, _ = bytes_served_to_b(tiered, engine_a, mooncake_tier(mooncake, "tiny-two-misplaced"))
    assert served != written


# --- another tenant misses --------------------------------------------------------------------------------------


def tenant_blind_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A control: every store key is named without its tenant, in the workers' tiers and the scheduler's lookups
    (patched before A forks, so both engines)."""
    def blind(namespace: Any, block_hash: int, salt: str | None = None) -> str:
        return object_key(namespace, block_hash)

    monkeypatch.setattr(mooncake_tier_module, "object_key", blind)
    monkeypatch.setattr(master_lookup, "object_key", blind)


def salt_blind_block_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A control: vLLM's block hashes leave `cache_salt` out (patched before A forks, so both engines)."""
    extra_keys = kv_cache_utils.generate_block_hash_extra_keys

    def unsalted(request: Any, *args: Any) -> Any:
        salt, request.cache_salt = request.cache_salt, None
        try:
            return extra_keys(request, *args)
        finally:
            request.cache_salt = salt

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", unsalted)


def another_tenant(tiered, engine_a, mooncake: LocalMooncake, by: str, model_id: str,
                   controls: tuple[Control, ...] = ()) -> Driver:
    """B serves a reader of another tenant than A's writer: by kvfsm's `tenant` option or by vLLM's `cache_salt`."""
    tenants = {"tenant": ({"tenant": "a"}, {"tenant": "b"}, None, None), "cache_salt": ({}, {}, "a", "b")}
    writer, reader, writer_salt, reader_salt = tenants[by]
    _, b, _ = served_in_b(tiered, engine_a, mooncake_tier(mooncake, model_id, **writer),
                          mooncake_tier(mooncake, model_id, **reader), writer_salt, reader_salt, controls)
    return b


@pytest.mark.parametrize("by", ["tenant", "cache_salt"])
def test_engine_b_of_another_tenant_misses_the_prefix_engine_a_wrote_back(tiered, engine_a, mooncake: LocalMooncake,
                                                                          by: str) -> None:
    assert missed(another_tenant(tiered, engine_a, mooncake, by, f"tiny-two-{by}"))


def test_control_tenant_blind_store_keys_let_the_other_tenant_find_the_prefix(
        tiered, engine_a, mooncake: LocalMooncake, monkeypatch: pytest.MonkeyPatch) -> None:
    """B's lookup finds A's values and orders a fetch; each value's MAC, keyed by A's tenant, still refuses it."""
    tenant_blind_keys(monkeypatch)
    b = another_tenant(tiered, engine_a, mooncake, "tenant", "tiny-two-blind-tenants", (tenant_blind_keys,))
    assert not missed(b) and fetches(b)
    assert b.connector.scheduler_side.kvfsm.tiers.stats.failures["corrupt"] > 0 and not reader_loads(b)


def test_control_salt_blind_block_hashes_serve_the_prefix_to_the_other_salt(
        tiered, engine_a, mooncake: LocalMooncake, monkeypatch: pytest.MonkeyPatch) -> None:
    salt_blind_block_hashes(monkeypatch)
    b = another_tenant(tiered, engine_a, mooncake, "cache_salt", "tiny-two-blind-salts", (salt_blind_block_hashes,))
    assert not missed(b) and len(reader_loads(b)) == 1
    assert b.connector.scheduler_side.kvfsm.tiers.stats.tokens_loaded_from["mooncake"] == len(PREFIX)


ZYGOTE = Zygote()
"""Forked last, so every control above is there to be named; at import, before any test set up a Mooncake client."""
