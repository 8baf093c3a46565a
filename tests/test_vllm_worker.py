"""The adapter's worker role on `SimDevice` tensors registered as vLLM registers them, under vLLM's real Scheduler.

Bytes, not bookkeeping: the forward pass writes each position's token id into the KV cache, so a reloaded block
shows whether its bytes came from the right prefix. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvfsm.connector.metadata import ConnectorMetadata, LoadOrder, StoreOrder  # noqa: E402
from kvfsm.connector.refusals import NotRegistered  # noqa: E402
from kvfsm.executor.transfer import Segments, UnknownLayer  # noqa: E402
from kvfsm.integrations.vllm import KvfsmConnector, UnsupportedKVCache, WrongRole  # noqa: E402
from kvfsm.integrations.vllm.config import cache_layout, gpu_block_bytes  # noqa: E402
from kvfsm.integrations.vllm.convert import KvfsmMetadata  # noqa: E402
from kvfsm.integrations.vllm.rig import (  # noqa: E402
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    kv_cache_config,
    model_config,
    vllm_config,
)
from vllm_harness import AdapterWorker, Driver  # noqa: E402

pytestmark = pytest.mark.vllm

PREFIX = list(range(300, 300 + 3 * BLOCK_SIZE))


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory):
    return vllm_config(model_config(Path(tmp_path_factory.mktemp("tiny-llama"))), {"cpu_blocks": 16}, 32)


def test_reloaded_blocks_hold_the_bytes_the_writer_computed(config) -> None:
    worker = AdapterWorker(config)
    d = Driver(config, worker)
    d.add("writer", PREFIX + [1])
    d.run()
    d.reset_gpu_prefix_cache()
    for cache in worker.caches.values():
        cache.zero_()  # whatever the reader finds now came from the CPU pool
    d.add("reader", PREFIX + [2])
    d.run()
    d.close()
    (load,) = [o for log in d.log for o in log.orders.loads if o.req_id == "reader"]
    for i, block in enumerate(load.gpu_blocks):
        assert worker.block_tokens(block) == [t % 251 for t in PREFIX[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]
    assert d.cpu_pool_drained()


def test_per_layer_stores_go_out_layer_by_layer_and_reload_the_right_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `layer_stores`, vLLM's `save_kv_layer` after each attention layer sends that layer's share of the
    step's stores at once; the bytes that come back are still the writer's."""
    sent: list[str] = []
    enqueue = Segments.enqueue

    def spy(self: Segments, segment: int, label: str) -> None:
        sent.append(label)
        enqueue(self, segment, label)

    monkeypatch.setattr(Segments, "enqueue", spy)
    config = vllm_config(model_config(tmp_path), {"cpu_blocks": 16, "layer_stores": True}, 32)
    worker = AdapterWorker(config)
    d = Driver(config, worker)
    d.add("writer", PREFIX + [1])
    d.run()
    stores = sorted({label.split(" layer ")[0] for label in sent if label.startswith("store")})
    assert stores and all(f"{job} layer {i}" in sent for job in stores for i in range(len(worker.caches)))
    d.reset_gpu_prefix_cache()
    for cache in worker.caches.values():
        cache.zero_()
    d.add("reader", PREFIX + [2])
    d.run()
    (load,) = [o for log in d.log for o in log.orders.loads if o.req_id == "reader"]
    for i, block in enumerate(load.gpu_blocks):
        assert worker.block_tokens(block) == [t % 251 for t in PREFIX[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]


def test_control_a_zeroed_cache_without_the_load_holds_no_prefix(config) -> None:
    worker = AdapterWorker(config)
    for cache in worker.caches.values():
        cache.zero_()
    assert worker.block_tokens(0) != [t % 251 for t in PREFIX[:BLOCK_SIZE]]


def test_failed_load_names_its_gpu_blocks_to_vllm(config) -> None:
    worker = AdapterWorker(config)
    bad = KvfsmMetadata(ConnectorMetadata(step=1, loads=(LoadOrder(job_id=0, req_id="r", gpu_blocks=(3, 4),
                                                                   cpu_slots=(0, 99)),)))
    worker.connector.handle_preemptions(bad)
    worker.connector.bind_connector_metadata(bad)
    worker.connector.start_load_kv(None)  # type: ignore[arg-type]
    worker.connector.wait_for_save()
    worker.connector.get_finished(set())
    assert worker.connector.get_block_ids_with_load_errors() == {3, 4}
    (report,) = worker.connector.build_connector_worker_meta().reports
    assert report.failed == (0,)


def test_a_failed_store_names_no_gpu_blocks_as_load_errors(config) -> None:
    """Only a failed load leaves GPU blocks vLLM must recompute; a failed store is reported, and no block with it."""
    worker = AdapterWorker(config)
    bad = ConnectorMetadata(step=1, stores=(StoreOrder(job_id=0, req_id="r", gpu_blocks=(3, 4), cpu_slots=(0, 99)),))
    for meta in (KvfsmMetadata(bad), KvfsmMetadata(ConnectorMetadata(step=2))):  # the next step sends the store
        worker.connector.handle_preemptions(meta)
        worker.connector.bind_connector_metadata(meta)
        worker.connector.start_load_kv(None)  # type: ignore[arg-type]
        worker.connector.wait_for_save()
        worker.connector.get_finished(set())
    assert worker.connector.get_block_ids_with_load_errors() == set()
    (report,) = worker.connector.build_connector_worker_meta().reports
    assert report.failed == (0,)


def test_the_worker_forgets_each_load_once_it_ended(config) -> None:
    """A load's GPU blocks are kept only until its end is collected (to name them should it fail): a worker that
    serves for days holds none of the loads that ended."""
    worker = AdapterWorker(config)
    d = Driver(config, worker)
    d.add("writer", PREFIX + [1])
    d.run()
    d.reset_gpu_prefix_cache()
    d.add("reader", PREFIX + [2])
    d.run()
    d.close()
    assert [o for log in d.log for o in log.orders.loads if o.req_id == "reader"]
    assert not worker.connector.worker_side._loads


def test_metadata_of_another_connector_is_refused_by_the_worker_naming_its_type(config) -> None:
    connector = KvfsmConnector(config, KVConnectorRole.WORKER, kv_cache_config(32))
    with pytest.raises(TypeError) as refused:
        connector.bind_connector_metadata(object())  # type: ignore[arg-type]
    assert str(refused.value) == "expected kvfsm connector metadata, got object"


def test_a_layer_hook_before_the_caches_are_registered_is_refused_by_name(config) -> None:
    connector = KvfsmConnector(config, KVConnectorRole.WORKER, kv_cache_config(32))
    with pytest.raises(NotRegistered):
        connector.wait_for_layer_load("model.layers.0.self_attn.attn")


@pytest.mark.parametrize("hook", ["wait_for_layer_load", "save_kv_layer"])
def test_a_layer_hook_for_a_layer_never_registered_is_refused_naming_it(config, hook: str) -> None:
    worker = AdapterWorker(config)
    args = ("layers.9.attn",) if hook == "wait_for_layer_load" else ("layers.9.attn", None, None)
    with pytest.raises(UnknownLayer, match="'layers.9.attn' is not a registered KV cache"):
        getattr(worker.connector, hook)(*args)


CPU_BYTES = 1 << 20
"""A pool sized by bytes (`cpu_bytes`): its blocks depend on a block's bytes, which the scheduler and each worker
compute apart (the scheduler from vLLM's KV-cache configuration, the worker from the tensors it registers)."""


def test_a_worker_sized_by_bytes_registers_the_pool_the_scheduler_sized(tmp_path: Path) -> None:
    config = vllm_config(model_config(tmp_path), {"cpu_bytes": CPU_BYTES}, 32)
    worker = AdapterWorker(config)  # registered: the worker's caches and the scheduler agree on the pool's blocks
    assert worker.connector.worker_side.kvfsm.transfers is not None


def test_caches_of_other_bytes_per_block_than_the_scheduler_sized_are_refused_with_both(tmp_path: Path) -> None:
    config = vllm_config(model_config(tmp_path), {"cpu_bytes": CPU_BYTES}, 32)
    connector = KvfsmConnector(config, KVConnectorRole.WORKER, kv_cache_config(32))
    layers = kv_cache_config(32).kv_cache_groups[0].layer_names
    caches = {name: torch.zeros(2, 32, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE // 2, dtype=torch.float16)
              for name in layers}
    theirs = gpu_block_bytes(kv_cache_config(32))
    ours = theirs // 2
    with pytest.raises(UnsupportedKVCache) as refused:
        connector.register_kv_caches(caches)
    assert str(refused.value) == (
        f"this worker's caches hold {ours} bytes per block, the scheduler sized the pool for {theirs}: the pools "
        f"would differ ({CPU_BYTES // ours} vs {CPU_BYTES // theirs} CPU blocks)")


def test_caches_of_an_unknown_layout_are_refused(config) -> None:
    connector = KvfsmConnector(config, KVConnectorRole.WORKER, kv_cache_config(32))
    with pytest.raises(UnsupportedKVCache, match="layout"):
        connector.register_kv_caches({"layer": torch.zeros(3, 32, BLOCK_SIZE, 2, 64, dtype=torch.float16)})


@pytest.mark.parametrize("shape, layout", [
    ((2, 32, BLOCK_SIZE, 2, 64), "kv-first"),
    ((32, 2, BLOCK_SIZE, 2, 64), "blocks-first"),
    ((32, BLOCK_SIZE, 576), "mla"),
])
def test_each_of_vllms_cache_shapes_is_told_its_layout_by_where_the_blocks_are(shape: tuple, layout: str) -> None:
    assert cache_layout({"layer": torch.empty(shape)}, 32) == layout


@pytest.mark.parametrize("shapes, num_blocks, refusal", [
    ([(3, 2, BLOCK_SIZE, 2, 64)], 32, "cannot tell the layout of a KV cache shaped (3, 2, 16, 2, 64) with 32 blocks "
                                      "(candidates: none)"),
    ([(32, 2, BLOCK_SIZE, 64)], 32, "cannot tell the layout of a KV cache shaped (32, 2, 16, 64) with 32 blocks "
                                    "(candidates: none)"),
    ([(2, 2, BLOCK_SIZE, 2, 64)], 2, "cannot tell the layout of a KV cache shaped (2, 2, 16, 2, 64) with 2 blocks "
                                     "(candidates: ['kv-first', 'blocks-first'])"),
    ([(2, 32, BLOCK_SIZE, 2, 64), (32, BLOCK_SIZE, 576)], 32, "KV caches in several layouts: ['kv-first', 'mla']"),
], ids=["no-layout", "four-axes", "two-layouts", "layouts-differ"])
def test_caches_of_no_one_layout_are_refused_saying_which(shapes: list[tuple], num_blocks: int, refusal: str) -> None:
    with pytest.raises(UnsupportedKVCache) as refused:
        cache_layout({f"layer {i}": torch.empty(shape) for i, shape in enumerate(shapes)}, num_blocks)
    assert str(refused.value) == refusal


def test_a_scheduler_call_on_a_worker_is_refused(config) -> None:
    connector = KvfsmConnector(config, KVConnectorRole.WORKER, kv_cache_config(32))
    with pytest.raises(WrongRole):
        connector.build_connector_meta(None)  # type: ignore[arg-type]


def test_importing_kvfsm_does_not_import_vllm() -> None:
    code = "import sys, kvfsm, kvfsm.integrations; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_control_importing_the_adapter_does_import_vllm() -> None:
    code = "import sys, kvfsm.integrations.vllm; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 1
