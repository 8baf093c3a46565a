"""A Mooncake tier under vLLM's real Scheduler, on a real `mooncake_master`: the scheduler process decides every
write-back and fetch, the adapter's real worker role puts and gets the values, and a prefix the CPU pool evicted comes
back Mooncake -> CPU -> GPU with its writer's bytes. Traced, checked after every step and drained, as on disk.
Skipped when vLLM or Mooncake is not installed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")

from vllm.distributed.kv_events import MEDIUM_STORAGE  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvfsm.config import MooncakeTierConfig  # noqa: E402
from kvfsm.integrations.vllm import KvfsmConnector  # noqa: E402
from kvfsm.integrations.vllm.master_lookup import KeyScheme, MasterLookup  # noqa: E402
from kvfsm.integrations.vllm.rig import kv_cache_config, vllm_config  # noqa: E402
from kvfsm.integrations.vllm.worker_tiers import WorkerTiers  # noqa: E402
from kvfsm.mooncake.errors import StoreUnavailable  # noqa: E402
from kvfsm.mooncake.keys import KvNamespace, object_key  # noqa: E402
from kvfsm.mooncake.secret import SecretUnavailable  # noqa: E402
from kvfsm.mooncake.local import LocalMooncake  # noqa: E402
from test_vllm_tiers import (  # noqa: E402
    MAX_STEPS,
    PREFIX,
    evict_from_cpu_then_reload,
    fetches,
    holds_prefix,
    misplace_fetches,
    prefix_keys,
    tiered,
)
from test_vllm_tier_telemetry import Recorded, replay  # noqa: E402
from vllm_support import model  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm


def mooncake_tier(deployment: LocalMooncake, model_id: str, **extra: Any) -> dict[str, Any]:
    """`model_id` keeps each test's keys apart in the module's shared store."""
    return {"kind": "mooncake", "master": str(deployment.address), "model_id": model_id, "kv_dtype": "float16",
            "writeback": "eager", "op_timeout_s": 10.0, "lookup_timeout_s": 1.0, **extra}


def test_prefix_evicted_from_cpu_returns_from_mooncake_with_the_writers_bytes(tiered, mooncake: LocalMooncake) -> None:
    d, (worker,) = tiered(mooncake_tier(mooncake, "tiny-reload"))
    (load,) = evict_from_cpu_then_reload(d, [worker])
    assert holds_prefix(worker, load)
    (fetch,) = fetches(d)
    assert fetch.tier == "mooncake" and list(fetch.keys) == prefix_keys(d, PREFIX)
    assert d.connector.scheduler_side.kvfsm.tiers.stats.tokens_loaded_from["mooncake"] == len(PREFIX)
    assert d.cpu_pool_drained()


def test_control_a_mooncake_fetch_that_lands_in_the_wrong_cpu_slots_is_caught_by_the_bytes(
        tiered, mooncake: LocalMooncake, monkeypatch: pytest.MonkeyPatch) -> None:
    misplace_fetches(monkeypatch)
    d, (worker,) = tiered(mooncake_tier(mooncake, "tiny-misplaced"))
    (load,) = evict_from_cpu_then_reload(d, [worker])
    assert not holds_prefix(worker, load)


def read_in_a_second_engine(tiered, writer_tier: dict[str, Any], reader_tier: dict[str, Any]) -> tuple[Any, Any]:
    """Engine A writes PREFIX back to the store; engine B, started afresh on the same master, steps once (its workers
    tell its scheduler their key namespaces) and then serves a reader of PREFIX. B's driver and worker."""
    a, _ = tiered(writer_tier)
    a.add("writer", PREFIX + [1, 2, 3])
    a.run(MAX_STEPS)
    b, (worker,) = tiered(reader_tier)
    b.step()
    b.add("reader", PREFIX + [9])
    b.run(MAX_STEPS)
    return b, worker


def test_a_second_engine_is_served_the_prefix_the_first_wrote_back_from_mooncake(tiered, mooncake: LocalMooncake
                                                                                  ) -> None:
    tier = mooncake_tier(mooncake, "tiny-shared")
    b, worker = read_in_a_second_engine(tiered, tier, tier)
    (load,) = [o for log in b.log for o in log.orders.loads if o.req_id == "reader"]
    assert holds_prefix(worker, load)
    assert b.connector.scheduler_side.kvfsm.tiers.stats.tokens_loaded_from["mooncake"] == len(PREFIX)
    assert b.cpu_pool_drained()


def test_another_tenant_misses_the_prefix_another_engine_wrote_back(tiered, mooncake: LocalMooncake) -> None:
    b, _ = read_in_a_second_engine(tiered, mooncake_tier(mooncake, "tiny-tenants", tenant="a"),
                                   mooncake_tier(mooncake, "tiny-tenants", tenant="b"))
    assert not fetches(b) and not [o for log in b.log for o in log.orders.loads if o.req_id == "reader"]
    assert "reader" in b.first_token


def test_control_workers_that_do_not_adopt_a_shared_fetchs_keys_serve_the_second_engine_nothing(
        tiered, mooncake: LocalMooncake, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler saw the keys on the master, but a worker that only reads keys it wrote itself fails the fetch
    (`missing`): the reader recomputes, which the sharing test above would catch. The run still drains: a key a
    fetch failed on is not adopted from the master again, so the reader is not deferred on it for ever."""
    monkeypatch.setattr(WorkerTiers, "apply", lambda self, meta: None)
    tier = mooncake_tier(mooncake, "tiny-not-adopted")
    b, _ = read_in_a_second_engine(tiered, tier, tier)
    assert fetches(b) and not [o for log in b.log for o in log.orders.loads if o.req_id == "reader"]
    assert b.connector.scheduler_side.kvfsm.tiers.stats.failures["missing"] > 0


def test_an_unreachable_master_stops_the_scheduler_at_start_up_by_name(model) -> None:
    config = vllm_config(model, {"cpu_blocks": 8, "lower_tiers": [
        {"kind": "mooncake", "master": "127.0.0.1:1", "model_id": "tiny", "kv_dtype": "float16"}]}, 64)
    with pytest.raises(StoreUnavailable) as refused:
        KvfsmConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(64))
    assert "127.0.0.1:1" in str(refused.value) and "\n" not in str(refused.value)


def test_blocks_entering_the_mooncake_tier_are_announced_as_remote_storage(tiered, mooncake: LocalMooncake) -> None:
    """Told apart from the disk tier's (LOCAL) and the CPU pool's (MEDIUM_CPU) by locality and owner."""
    d, (worker,) = tiered(mooncake_tier(mooncake, "tiny-events"), kv_events=True)
    published = Recorded()
    d.scheduler.kv_event_publisher = published
    evict_from_cpu_then_reload(d, [worker])
    storage = {(e.locality, e.ownership) for e in published.events if getattr(e, "medium", None) == MEDIUM_STORAGE}
    assert storage == {("REMOTE", "mooncake")}
    codec = d.connector.scheduler_side.codec
    assert {codec.to_bytes(k) for k in prefix_keys(d, PREFIX)} <= replay(published.events)[
        (MEDIUM_STORAGE, "REMOTE", "mooncake")]


# --- the scheduler's lookup on the master, its answers given by hand ----------------------------------------------

RANKS = [KvNamespace(model_id="tiny-lookup", dtype="float16", layout=f"rank {rank}", block_tokens=16)
         for rank in range(2)]
"""Two ranks' namespaces: a block is held whole only when both ranks' values are."""


class Answered:
    """The master's answer to one `contains` call, there at once (None: no answer within the bound)."""

    def __init__(self, answers: list[bool | Exception] | None) -> None:
        self.answers = answers

    def wait(self, timeout_s: float) -> list[bool | Exception] | None:
        return self.answers


def lookup_answering(deployment: LocalMooncake, monkeypatch: pytest.MonkeyPatch, answers: list[bool | Exception] | None,
                     asked: list[list[str]] | None = None, **extra: Any) -> MasterLookup:
    """A lookup of two ranks on the real master, whose `contains` answers `answers` (and records what it was asked)."""
    lookup = MasterLookup(MooncakeTierConfig(**mooncake_tier(deployment, "tiny-lookup", **extra)), num_workers=2)
    for rank, namespace in enumerate(RANKS):
        lookup.learn(rank, KeyScheme(namespace))

    def contains(names: Sequence[str]) -> Answered:
        if asked is not None:
            asked.append(list(names))
        return Answered(answers)

    monkeypatch.setattr(lookup.client, "contains", contains)
    return lookup


def test_the_master_lookup_counts_the_leading_blocks_whose_every_ranks_value_is_held(
        mooncake: LocalMooncake, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block is asked under every rank's name, in the tenant's names; the count stops at the first block one
    rank's value of is missing (the third block, held whole, is not counted)."""
    asked: list[list[str]] = []
    lookup = lookup_answering(mooncake, monkeypatch, [True, True, False, True, True, True], asked, tenant="t")
    assert lookup.present([7, 8, 9]) == 1
    assert asked == [[object_key(namespace, key, "t") for key in (7, 8, 9) for namespace in RANKS]]
    lookup.close()


def test_the_master_lookup_counts_every_block_held_whole(mooncake: LocalMooncake,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    lookup = lookup_answering(mooncake, monkeypatch, [True] * 6)
    assert lookup.present([7, 8, 9]) == 3
    lookup.close()


def test_a_master_that_does_not_answer_within_the_bound_is_a_miss_warned_naming_the_tier_and_bound(
        mooncake: LocalMooncake, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    lookup = lookup_answering(mooncake, monkeypatch, None)
    with caplog.at_level(logging.WARNING, logger="kvfsm.integrations.vllm.master_lookup"):
        assert lookup.present([7, 8]) == 0
    assert caplog.messages == ["mooncake tier mooncake: the master did not answer within 1.0s; counted as a miss"]
    lookup.close()


def test_a_fault_in_the_masters_answer_is_a_miss_from_its_block_on_warned_naming_the_tier_and_fault(
        mooncake: LocalMooncake, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fault = StoreUnavailable("lookup of k failed")
    lookup = lookup_answering(mooncake, monkeypatch, [True, True, True, fault, True, True])
    with caplog.at_level(logging.WARNING, logger="kvfsm.integrations.vllm.master_lookup"):
        assert lookup.present([7, 8, 9]) == 1
    assert caplog.messages == ["mooncake tier mooncake: lookup: StoreUnavailable: lookup of k failed"]
    lookup.close()


def test_the_master_lookup_needs_the_tenants_secret_as_the_workers_do(
        mooncake: LocalMooncake, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Read from the configured file, else from the environment: with neither the scheduler stops at start-up."""
    monkeypatch.delenv("KVFSM_MOONCAKE_SECRET")
    with pytest.raises(SecretUnavailable, match="KVFSM_MOONCAKE_SECRET"):
        MasterLookup(MooncakeTierConfig(**mooncake_tier(mooncake, "tiny-lookup")), num_workers=1)
    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-at-least-32-bytes-0123456789")
    MasterLookup(MooncakeTierConfig(**mooncake_tier(mooncake, "tiny-lookup", secret_file=str(secret))),
                 num_workers=1).close()


def test_the_master_lookups_client_runs_under_the_tiers_bounds(mooncake: LocalMooncake) -> None:
    """Its calls' deadline, its back-off after a failure and its queue are the tier's, as the workers' clients'."""
    lookup = MasterLookup(MooncakeTierConfig(**mooncake_tier(mooncake, "tiny-lookup", retry_after_s=0.5,
                                                             max_pending=7)), num_workers=1)
    settings = lookup.client.settings
    assert (settings.op_timeout_s, settings.retry_after_s, settings.max_pending) == (10.0, 0.5, 7)
    lookup.close()
