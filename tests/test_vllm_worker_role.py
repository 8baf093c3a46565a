"""The worker-role connector as vLLM's worker process holds it: the step's metadata bound where vLLM's attention layers
look for it, the rank its reports carry under `torch.distributed`, and its shutdown. Skipped without vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvfsm.executor.sim import SimDevice  # noqa: E402
from kvfsm.integrations.vllm.rig import model_config, vllm_config  # noqa: E402
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import PREFIX, model  # noqa: E402,F401

pytestmark = pytest.mark.vllm


class LayerWatcher(AdapterWorker):
    """The adapter's worker, noting before each forward pass whether the connector holds bound metadata: vLLM's
    attention layers call `wait_for_layer_load` and `save_kv_layer` only when it does (`has_connector_metadata`)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.bound: list[bool] = []

    def forward(self, *args: Any) -> None:
        self.bound.append(self.connector.has_connector_metadata())
        super().forward(*args)


def test_the_steps_metadata_is_bound_where_vllms_attention_layers_look_for_it(model) -> None:
    config = vllm_config(model, {"cpu_blocks": 32}, 64)
    worker = LayerWatcher(config)
    d = Driver(config, worker)
    try:
        d.add("writer", PREFIX + [1, 2, 3])
        d.run()
    finally:
        d.close()
    assert worker.bound and all(worker.bound), f"metadata bound in forward passes: {worker.bound}"


def test_a_worker_role_connector_reports_as_its_place_in_its_engine(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Global rank 3 of data-parallel engines of one worker each is its engine's worker 0."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    worker = AdapterWorker(vllm_config(model_config(tmp_path), {"cpu_blocks": 16}, 32))
    assert worker.connector.worker_side.kvfsm.worker == 0


def test_a_worker_role_connector_shuts_down_releasing_its_host_pool(tmp_path: Path) -> None:
    worker = AdapterWorker(vllm_config(model_config(tmp_path), {"cpu_blocks": 16}, 32))
    device = worker.connector.worker_side.kvfsm.device
    assert isinstance(device, SimDevice) and device.host_bytes > 0
    worker.connector.shutdown()
    assert device.host_bytes == 0
