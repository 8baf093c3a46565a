"""The vLLM worker's per-layer reload bench on the simulator: its byte count and its controls, without a GPU.

The same code runs on CUDA (`tests/test_gpu_vllm_worker.py`, `python -m kvfsm.bench vllm-layers`); here a small
prefix checks that the count of wrong bytes can fail and that the stand-in for vLLM leaves nothing behind.
"""

from __future__ import annotations

import importlib.util

import pytest

from kvfsm.bench import vllm_layers
from kvfsm.bench.goals import verdicts
from kvfsm.executor import SimDevice
from kvfsm.executor.transfer import Segments
from kvfsm.integrations.vllm_stand_in import standing_in

SMALL = vllm_layers.Prefix(tokens=256, layers=2, kv_heads=2, head_dim=16, spare_blocks=8)


def test_the_reload_reads_every_stored_byte_in_its_step_and_the_race_control_is_caught() -> None:
    row = vllm_layers.run(SimDevice(), SMALL, trials=2, race_trials=2, h2d_gbps=10.0)
    assert row["differing_blocks"] == 0 and row["race_control_caught"] == 2
    assert row["prefix_bytes"] == 2 * 16 * (2 * 16 * 2 * 16 * 2)  # layers x blocks x (K and V of one block, bf16)
    assert row["floor_ms"] == pytest.approx(row["prefix_bytes"] / 10.0 / 1e6)


def test_control_a_reload_whose_segments_never_land_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with standing_in():
        reload = vllm_layers.LayerReload(SimDevice(), SMALL)
        monkeypatch.setattr(Segments, "enqueue", lambda self, segment, label: None)  # no layer ever lands
        trial = reload.trial()
        reload.close()
    assert trial.differing_blocks == 2 * SMALL.blocks


def test_the_stand_in_for_vllm_is_gone_after_the_run() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: no stand-in is used")
    vllm_layers.run(SimDevice(), SMALL, trials=1, race_trials=1)
    assert importlib.util.find_spec("vllm") is None


def test_the_floor_goal_is_judged_only_on_the_full_32_layer_32k_prefix() -> None:
    def judged(layers: int, over_floor: float) -> list[bool]:
        row = {"prompt_tokens": 32768, "layers": layers, "median_over_floor": over_floor, "trials": 9}
        return [v["met"] for v in verdicts({"vllm_layers": row}) if "vLLM worker" in v["goal"]]

    assert judged(32, 1.10) == [True] and judged(32, 1.20) == [False]
    assert judged(4, 1.10) == []  # `--quick`'s four layers say nothing about the goal
