"""The vLLM adapter's worker half on a real GPU with `layer_loads`, in vLLM's hook order, without vLLM installed.

`kvfsm.bench.vllm_layers` drives the adapter's `WorkerSide` as vLLM's model runner does (`handle_preemptions`,
`bind`, `start_load_kv`, per layer `wait_for_layer_load`, the layer's reads, `save_kv_layer`, then `wait_for_save`
and the step's reports) to reload a 32k-token prefix shaped as Llama-3-8B's KV (32 layers, 8 KV heads of 128, bf16,
16-token blocks: 4 GiB) from the pinned pool into scattered GPU blocks. Every byte a layer reads must be the stored
one and the load reported in the output of the step that computed on it; each rule has its control. Times are the
bench's to report (`python -m kvfsm.bench vllm-layers`), never asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfsm.bench import vllm_layers
from kvfsm.bench.__main__ import app
from kvfsm.executor.cuda import CudaDevice
from kvfsm.integrations.vllm_stand_in import standing_in

pytestmark = pytest.mark.gpu


@pytest.fixture
def reload():
    with standing_in():
        reload = vllm_layers.LayerReload(CudaDevice())
        yield reload
        reload.close()


def test_the_adapters_worker_reloads_a_32k_llama_8b_prefix_layer_by_layer(reload) -> None:
    trial = reload.trial()
    assert trial.differing_blocks == 0, f"{trial.differing_blocks} layer blocks read before their bytes landed"
    assert trial.reported_in_step


def test_control_a_layer_that_reads_without_waiting_for_its_segment_reads_wrong_bytes(reload) -> None:
    caught = sum(reload.trial(wait_layers=False).differing_blocks > 0 for _ in range(20))
    assert caught > 0  # a race the count cannot see would leave the rule above untested


def test_control_a_worker_that_does_not_wait_reports_the_load_after_its_step(reload, monkeypatch) -> None:
    monkeypatch.setattr(reload.worker.kvfsm, "wait", lambda job_ids: None)  # the layers' GPU waits stay
    trial = reload.trial()
    assert trial.differing_blocks == 0 and not trial.reported_in_step


def test_the_vllm_layers_part_runs_and_reads_every_byte_right(tmp_path: Path) -> None:
    run = CliRunner().invoke(app, ["vllm-layers", "--quick", "--out", str(tmp_path)])
    assert run.exit_code == 0, run.output
    row = json.loads((tmp_path / "bench.json").read_text())["vllm_layers"]
    assert row["differing_blocks"] == 0 and row["race_control_caught"] > 0
    assert row["prefix_bytes"] == 4 * 2048 * 2 * 16 * 8 * 128 * 2  # quick: 4 layers of the 32k prefix
