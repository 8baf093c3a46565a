"""`python -m kvfsm.bench vllm`'s hybrid workload: under vLLM's hybrid allocator kvfsm moves no more blocks of either
group than vLLM's own OffloadingConnector, and vLLM holds no more GPU blocks for it. Skipped without vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm.bench_hybrid import GROUPS, measure, returning_documents  # noqa: E402
from vllm_support import model  # noqa: E402,F401

pytestmark = pytest.mark.vllm


def test_kvfsm_moves_no_more_blocks_per_group_and_holds_no_more_than_vllms_connector(model) -> None:
    workload = returning_documents(documents=1, doc_tokens=160, per_step=1, steps=2)
    vllm, kvfsm = (measure(connector, model, workload) for connector in ("vllm", "kvfsm"))
    assert vllm["sliding_loaded"] > 0, "vLLM's connector reloaded no window: the workload returns to no document"
    for group in GROUPS:
        for kind in ("loaded", "stored"):
            assert kvfsm[f"{group}_{kind}"] <= vllm[f"{group}_{kind}"], (group, kind, kvfsm, vllm)
    assert kvfsm["gpu_blocks_held_max"] <= vllm["gpu_blocks_held_max"]
