"""The vLLM adapter hands vLLM's KV-cache size to kvfsm, so a block id beyond it is refused by name, not copied.

Skipped when vLLM is not installed (the main suite runs without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvfsm.connector.refusals import BlockIdOutOfRange  # noqa: E402
from kvfsm.integrations.vllm.rig import FakeWorker, model_config, vllm_config  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from kvfsm.testing.snapshot import snapshot  # noqa: E402

pytestmark = pytest.mark.vllm


@dataclass
class Req:
    request_id: str
    block_hashes: tuple[int, ...]
    num_tokens: int


def test_a_block_beyond_vllms_kv_cache_is_refused_at_allocation(tmp_path: Path) -> None:
    d = Driver(vllm_config(model_config(tmp_path), {"cpu_blocks": 8}, 32), FakeWorker())
    kvfsm = d.connector.scheduler_side.kvfsm
    assert kvfsm.num_gpu_blocks == d.blocks == 32
    request = Req("r", (), 5)
    kvfsm.get_num_new_matched_tokens(request, 0)
    before = snapshot(kvfsm)
    with pytest.raises(BlockIdOutOfRange, match=r"\[32\].*legal ids: \[0, 32\)"):
        kvfsm.update_state_after_alloc(request, [0, 32], 0)
    assert snapshot(kvfsm) == before
