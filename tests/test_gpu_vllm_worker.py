"""The vLLM adapter's worker half on a real GPU with `layer_loads`, in vLLM's hook order, without vLLM installed.

A 32k-token prefix shaped as Llama-3-8B's KV (32 layers, 8 KV heads of 128, bf16, 16-token blocks: 4 GiB) is stored
through `WorkerSide`, then reloaded into scattered GPU blocks in one step: `handle_preemptions`, `bind`,
`start_load_kv`, then per layer `wait_for_layer_load` and a read of that layer's blocks on the compute stream (as
attention would), `save_kv_layer`, `wait_for_save`, and the step's reports. Every byte compute read must be the
stored one, the load reported done in that step's output, no block named for recompute. The reload's time against
one pinned host-to-device copy of the same bytes (its floor) is printed, not asserted.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import vllm_stand_in

pytestmark = pytest.mark.gpu

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16
TOKENS = 32 * 1024
BLOCKS = TOKENS // BLOCK


def step(worker, meta, read: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One engine step in vLLM's hook order; `read`: per layer, the blocks attention reads after its wait."""
    seen = {}
    worker.handle_preemptions(meta)
    worker.bind(meta)
    worker.start_load_kv()
    for name, blocks in (read or dict.fromkeys(worker.caches)).items():
        worker.wait_for_layer_load(name)
        if blocks is not None:
            seen[name] = worker.caches[name][:, blocks].clone()  # on the compute stream, no host sync
        worker.save_kv_layer(name)
    worker.wait_for_save()
    worker.poll()
    return seen


def reload_in_hook_order(monkeypatch: pytest.MonkeyPatch, wait: bool) -> tuple[Any, int, float]:
    """Store the prefix, reload it in one step; the step's report, the layer blocks compute read wrong, and the
    reload's time over the floor's. `wait=False` is the control: the worker reports without waiting for the
    step's loads (the rule `inline-load-in-step` would then break)."""
    vllm_stand_in.install()
    from kvfsm.config import OffloadConfig
    from kvfsm.connector.metadata import ConnectorMetadata, LoadOrder, StoreOrder
    from kvfsm.executor.cuda import CudaDevice
    from kvfsm.integrations.vllm.convert import KvfsmMetadata
    from kvfsm.integrations.vllm.worker_side import WorkerSide

    num_blocks = BLOCKS + 64
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    caches = {n: torch.empty(2, num_blocks, BLOCK, HEADS, DIM, dtype=torch.bfloat16, device="cuda") for n in names}
    spec = SimpleNamespace(page_size_bytes=2 * BLOCK * HEADS * DIM * 2)
    kv_cache_config = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=spec, layer_names=names)])
    worker = WorkerSide(OffloadConfig(cpu_blocks=BLOCKS, gpu_block_size=BLOCK, layer_loads=True), kv_cache_config,
                        CudaDevice(), 0)
    worker.register_kv_caches(caches)
    worker.caches = caches
    for cache in caches.values():
        cache.view(torch.int16).random_()
    source = tuple(range(BLOCKS))
    expected = {n: c[:, list(source)].clone() for n, c in caches.items()}
    slots = tuple(range(BLOCKS))
    step(worker, KvfsmMetadata(ConnectorMetadata(step=1, stores=(
        StoreOrder(job_id=0, req_id="writer", gpu_blocks=source, cpu_slots=slots),))))
    step(worker, KvfsmMetadata(ConnectorMetadata(step=2)))
    worker.kvfsm.wait([0])
    worker.poll()
    assert worker.take_worker_meta().reports[-1].done == (0,)
    for cache in caches.values():
        cache.zero_()

    if not wait:  # the step's report no longer waits for its loads; the layers' waits on the GPU stay
        monkeypatch.setattr(worker.kvfsm, "wait", lambda job_ids: None)
    destination = tuple(torch.randperm(num_blocks)[:BLOCKS].tolist())
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    seen = step(worker, KvfsmMetadata(ConnectorMetadata(step=3, loads=(
        LoadOrder(job_id=1, req_id="reader", gpu_blocks=destination, cpu_slots=slots),))),
        read=dict.fromkeys(names, list(destination)))
    end.record()
    torch.cuda.synchronize()
    meta = worker.take_worker_meta()
    report = meta.reports[0] if meta is not None else None
    assert worker.take_load_errors() == set()
    differing = sum(int((seen[n].view(torch.int16) != expected[n].view(torch.int16)).any(dim=(0, 2, 3, 4)).sum())
                    for n in names)  # compared as bits: random bf16 bits include NaNs

    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    floor_start, floor_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    floor_start.record()
    target.copy_(host, non_blocking=True)
    floor_end.record()
    torch.cuda.synchronize()
    reload_ms, floor_ms = start.elapsed_time(end), floor_start.elapsed_time(floor_end)
    print(f"32k Llama-3-8B prefix ({nbytes / 2**30:.2f} GiB) reloaded per layer in {reload_ms:.1f} ms in vLLM's "
          f"hook order (compute reading every layer); one pinned H2D copy {floor_ms:.1f} ms: "
          f"{reload_ms / floor_ms:.2f}x the floor")
    worker.shutdown()
    return report, differing, reload_ms / floor_ms


def test_the_adapters_worker_reloads_a_32k_llama_8b_prefix_layer_by_layer(monkeypatch) -> None:
    report, differing, _ = reload_in_hook_order(monkeypatch, wait=True)
    assert differing == 0, f"{differing} layer blocks read before their bytes landed, or wrong"
    assert report is not None and report.done == (1,)  # reported in the output of the step that computed on it


def test_control_a_worker_that_does_not_wait_reports_the_load_after_its_step(monkeypatch) -> None:
    report, differing, _ = reload_in_hook_order(monkeypatch, wait=False)
    assert differing == 0  # compute still waited per layer on the GPU
    assert report is None or 1 not in report.done
