"""The adapter's rules at the edges of vLLM's configuration: a window's or a state's first kept block as vLLM's own
managers count it, for blocks of one token too; a vLLM configuration without a transfer configuration; the pool gauge
under Prometheus' multiprocess mode (several API servers). Skipped without vLLM.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from hypothesis import given, strategies as st  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import MambaManager, SlidingWindowManager  # noqa: E402

from kvfsm.integrations.vllm import InvalidExtraConfig, KvfsmConnector  # noqa: E402
from kvfsm.integrations.vllm.config import offload_config  # noqa: E402
from kvfsm.integrations.vllm.groups import Group  # noqa: E402
from kvfsm.integrations.vllm.rig import model_config, vllm_config  # noqa: E402
from kvfsm.integrations.vllm.telemetry import POOL  # noqa: E402

pytestmark = pytest.mark.vllm


def vllm_first_kept(skipped_tokens: int, block_size: int) -> int:
    """The first block vLLM's manager still holds: it frees the blocks its skipped tokens fill, none when it skips
    none (`remove_skipped_blocks`)."""
    return max(0, skipped_tokens) // block_size


@given(st.integers(0, 200), st.integers(1, 64), st.sampled_from((1, 2, 16)))
def test_a_windows_first_kept_block_is_vllms_for_any_block_size(tokens: int, window: int, block_size: int) -> None:
    skipped = SlidingWindowManager.get_num_skipped_tokens(
        SimpleNamespace(sliding_window=window, extra_retained_tokens=0), tokens)
    assert Group(1, 1, window).first_kept(tokens, block_size) == vllm_first_kept(skipped, block_size)


@given(st.integers(0, 200), st.sampled_from((1, 2, 16)))
def test_a_states_first_kept_block_is_vllms_for_any_block_size(tokens: int, block_size: int) -> None:
    skipped = MambaManager.get_num_skipped_tokens(SimpleNamespace(), tokens)
    assert Group(1, 1, None, state=True).first_kept(tokens, block_size) == vllm_first_kept(skipped, block_size)


def test_a_vllm_configuration_without_a_transfer_configuration_is_refused_for_its_missing_pool_size(
        tmp_path: Path) -> None:
    config = vllm_config(model_config(tmp_path), {"cpu_blocks": 16}, 32)
    config.kv_transfer_config = None
    with pytest.raises(InvalidExtraConfig, match="cpu_blocks and cpu_bytes"):
        offload_config(config)


def test_the_pool_gauge_is_one_series_per_state_across_api_server_processes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Prometheus' multiprocess mode each process writes its samples to a file and the scrape merges them: the
    pool's blocks per state are the latest any process set, not a series per process id."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    config = vllm_config(model_config(tmp_path / "model"), {"cpu_blocks": 16}, 32)
    types = {kind: partial(kind, registry=CollectorRegistry()) for kind in (Counter, Gauge, Histogram)}
    metrics = KvfsmConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    metrics.observe({POOL + "ready": 5}, engine_idx=0)
    scrape = CollectorRegistry()
    MultiProcessCollector(scrape, path=str(tmp_path))
    samples = [s for family in scrape.collect() if family.name == "kvfsm_pool_blocks" for s in family.samples]
    assert [(s.labels, s.value) for s in samples] == [({"model_name": "tiny", "engine": "0", "state": "ready"}, 5)]
