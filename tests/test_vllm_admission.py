"""Admission under vLLM's real Scheduler: vLLM's `offload_prompt_only` read as kvfsm's `admission`, decode blocks
skipped, and the skips counted through vLLM's own stats hook and Prometheus metrics. Skipped without vLLM."""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvfsm.integrations.vllm import InvalidExtraConfig, KvfsmConnector  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker, vllm_config  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, model  # noqa: E402,F401

pytestmark = pytest.mark.vllm

DECODED_BLOCKS = 2


@pytest.fixture
def driver(model) -> Iterator:
    opened: list[Driver] = []

    def build(**extra: Any) -> Driver:
        d = Driver(vllm_config(model, {"cpu_blocks": 32, **extra}, 64), FakeWorker())
        opened.append(d)
        return d

    yield build
    for d in opened:
        d.close()


def decode_past_the_prompt(d: Driver) -> None:
    """A four-block prompt (and three tokens more) decodes two whole blocks past it."""
    d.add("a", PREFIX + [1, 2, 3], max_tokens=DECODED_BLOCKS * BLOCK_SIZE + 1)
    d.run()


def stored_blocks(d: Driver) -> int:
    return sum(len(order.gpu_blocks) for log in d.log for order in log.orders.stores)


def test_offload_prompt_only_is_read_as_prompt_only_admission(driver) -> None:
    d = driver(offload_prompt_only=True)
    decode_past_the_prompt(d)
    stats = d.connector.scheduler_side.kvfsm.stats
    assert stored_blocks(d) == len(PREFIX) // BLOCK_SIZE
    assert stats.blocks_skipped_prompt_only == DECODED_BLOCKS


def test_offload_prompt_only_false_stores_decode_blocks_too(driver) -> None:
    d = driver(offload_prompt_only=False)
    decode_past_the_prompt(d)
    assert stored_blocks(d) == len(PREFIX) // BLOCK_SIZE + DECODED_BLOCKS


@pytest.mark.parametrize("extra, message", [
    ({"offload_prompt_only": True, "admission": "every-block"}, "contradict"),
    ({"offload_prompt_only": "yes"}, "offload_prompt_only='yes'"),
])
def test_a_bad_or_contradicting_offload_prompt_only_fails_at_start_up(driver, extra: dict[str, Any],
                                                                       message: str) -> None:
    with pytest.raises(InvalidExtraConfig, match=message):
        driver(**extra)


def test_skipped_blocks_reach_vllms_metrics_by_reason(driver) -> None:
    d = driver(admission="prompt-only")
    decode_past_the_prompt(d)
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    metrics = KvfsmConnector.build_prom_metrics(d.scheduler.vllm_config, types, ["model_name", "engine"],
                                                {0: ["tiny", "0"]})
    for payload in d.connector_stats:
        metrics.observe(payload, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("kvfsm_store_skipped_total", labels | {"reason": "prompt-only"}) == DECODED_BLOCKS
    assert registry.get_sample_value("kvfsm_store_skipped_total", labels | {"reason": "threshold"}) == 0
