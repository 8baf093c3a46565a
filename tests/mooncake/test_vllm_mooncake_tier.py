"""A Mooncake tier under vLLM's real Scheduler, on a real `mooncake_master`: the scheduler process decides every
write-back and fetch, the adapter's real worker role puts and gets the values, and a prefix the CPU pool evicted comes
back Mooncake -> CPU -> GPU with its writer's bytes. Traced, checked after every step and drained, as on disk.
Skipped when vLLM or Mooncake is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")

from kvfsm.mooncake.local import LocalMooncake  # noqa: E402
from test_vllm_tiers import (  # noqa: E402
    PREFIX,
    evict_from_cpu_then_reload,
    fetches,
    holds_prefix,
    misplace_fetches,
    prefix_keys,
    tiered,
)
from vllm_support import model  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm


def mooncake_tier(deployment: LocalMooncake, model_id: str) -> dict[str, Any]:
    """`model_id` keeps each test's keys apart in the module's shared store."""
    return {"kind": "mooncake", "master": str(deployment.address), "model_id": model_id, "kv_dtype": "float16",
            "writeback": "eager", "op_timeout_s": 10.0, "lookup_timeout_s": 1.0}


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
