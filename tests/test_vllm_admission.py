"""Admission under vLLM's real Scheduler: vLLM's `offload_prompt_only` read as kvfsm's `admission`, decode blocks
skipped, and the skips counted through vLLM's own stats hook and Prometheus metrics. Skipped without vLLM."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm import InvalidExtraConfig  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, make_driver, model, scraped  # noqa: E402,F401

pytestmark = pytest.mark.vllm

DECODED_BLOCKS = 2


def decode_past_the_prompt(d: Driver) -> None:
    """A four-block prompt (and three tokens more) decodes two whole blocks past it."""
    d.add("a", PREFIX + [1, 2, 3], max_tokens=DECODED_BLOCKS * BLOCK_SIZE + 1)
    d.run()


def stored_blocks(d: Driver) -> int:
    return sum(len(order.gpu_blocks) for log in d.log for order in log.orders.stores)


def test_offload_prompt_only_is_read_as_prompt_only_admission(make_driver) -> None:
    d = make_driver(offload_prompt_only=True)
    decode_past_the_prompt(d)
    stats = d.connector.scheduler_side.kvfsm.stats
    assert stored_blocks(d) == len(PREFIX) // BLOCK_SIZE
    assert stats.blocks_skipped_prompt_only == DECODED_BLOCKS


def test_offload_prompt_only_false_stores_decode_blocks_too(make_driver) -> None:
    d = make_driver(offload_prompt_only=False)
    decode_past_the_prompt(d)
    assert stored_blocks(d) == len(PREFIX) // BLOCK_SIZE + DECODED_BLOCKS


@pytest.mark.parametrize("extra, message", [
    ({"offload_prompt_only": True, "admission": "every-block"},
     "kv_connector_extra_config sets offload_prompt_only=True and admission='every-block'; they contradict (give one)"),
    ({"offload_prompt_only": "yes"},
     "kv_connector_extra_config sets offload_prompt_only='yes'; legal: true or false (read as kvfsm's admission)"),
])
def test_a_bad_or_contradicting_offload_prompt_only_fails_at_start_up(make_driver, extra: dict[str, Any],
                                                                       message: str) -> None:
    with pytest.raises(InvalidExtraConfig) as refused:
        make_driver(**extra)
    assert str(refused.value) == message


def test_skipped_blocks_reach_vllms_metrics_by_reason(make_driver) -> None:
    d = make_driver(admission="prompt-only")
    decode_past_the_prompt(d)
    registry = scraped(d)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("kvfsm_store_skipped_total", labels | {"reason": "prompt-only"}) == DECODED_BLOCKS
    assert registry.get_sample_value("kvfsm_store_skipped_total", labels | {"reason": "threshold"}) == 0
