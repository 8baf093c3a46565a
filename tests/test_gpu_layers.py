"""Per-layer loads on a real GPU: compute of layer i waits for layer i's segment, on the GPU, and for nothing else.

The load stream starts late (a busy copy engine) and each layer's segment is large, so a compute stream that
does not wait for the right segment reads a layer before it landed. Two controls: compute that waits on nothing,
and compute that waits on layer 0's segment for every layer (the `wait-on-wrong-layer` mutant). Both must
corrupt in most trials; kvfsm in none.
"""

from __future__ import annotations

import pytest
import torch

from kvfsm.config import OffloadConfig
from kvfsm.connector import Connector
from kvfsm.connector.metadata import ConnectorMetadata, LoadOrder
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.transfer import Segments
from kvfsm.testing.mutants import MUTANTS

pytestmark = pytest.mark.gpu
TRIALS = 20
LAYERS, BLOCKS = 4, 512  # 32 MiB per layer segment: ~0.6 ms of DMA each
SLEEP_CYCLES = 20_000_000  # ~10 ms the load stream is busy before the load


def layer_race(control: str | None, scattered: bool = False) -> int:
    """Trials in which some layer's compute read its blocks before they landed; `scattered`: the load reads CPU
    slots in random order, so it goes out whole in its first segment (`transfer.MIN_LAYER_COPY_BYTES`)."""
    from kvfsm.executor.cuda import CudaDevice

    device = CudaDevice()
    tensors, _ = allocate_kv_caches("kv-first", LAYERS, BLOCKS, 16, 8, 128, torch.bfloat16, "cuda")
    connector = Connector(OffloadConfig(cpu_blocks=BLOCKS, gpu_block_size=16, layer_loads=True), device)
    connector.register_kv_caches(tensors, "kv-first")
    worker = connector.worker
    if control == "wrong-layer":
        MUTANTS["wait-on-wrong-layer"].apply(None, connector)  # type: ignore[arg-type]
    worker.pool.buffer.fill_(0x5A)
    landed = torch.full((), 0x5A, dtype=torch.uint8, device="cuda")
    blocks = torch.randperm(BLOCKS).tolist()
    slots = tuple(torch.randperm(BLOCKS).tolist()) if scattered else tuple(range(BLOCKS))
    corrupt = 0
    for trial in range(TRIALS):
        for cache in tensors.values():
            cache.view(torch.uint8).zero_()
        torch.cuda.synchronize()
        device.enqueue("load", "load", "copy engine busy", lambda: torch.cuda._sleep(SLEEP_CYCLES))
        order = LoadOrder(job_id=trial, req_id=f"r{trial}", gpu_blocks=tuple(blocks), cpu_slots=slots)
        worker.bind_connector_metadata(ConnectorMetadata(step=trial + 1, loads=(order,)))
        worker.start_load_kv()
        seen = []
        for name, cache in tensors.items():
            if control != "no-wait":
                worker.wait_for_layer_load(name)
            seen.append((cache.view(torch.uint8) == landed).all())  # read on the compute stream, no host sync
        worker.wait([trial])
        torch.cuda.synchronize()
        report = worker.get_finished()
        assert report.done == (trial,)
        corrupt += not all(bool(s) for s in seen)
    worker.shutdown()
    return corrupt


def test_layer_waits_for_its_own_segment_and_the_controls_corrupt(record_property) -> None:
    results = {control or "kvfsm": layer_race(control) for control in (None, "no-wait", "wrong-layer")}
    record_property("corrupt", {**results, "trials": TRIALS})
    print(f"\nper-layer load race, corrupt trials of {TRIALS}: {results}")
    assert results["kvfsm"] == 0
    assert results["no-wait"] > TRIALS // 2
    assert results["wrong-layer"] > TRIALS // 2


def test_a_load_sent_whole_lands_every_layer_before_its_first_segment_s_event(
        monkeypatch: pytest.MonkeyPatch, record_property) -> None:
    """A load from scattered slots goes out whole in its first segment; every layer's wait must still follow its
    bytes. Controls: compute that waits on nothing, and the whole load sent with the last segment instead."""
    results = {control or "kvfsm": layer_race(control, scattered=True) for control in (None, "no-wait")}
    send = Segments.enqueue
    monkeypatch.setattr(Segments, "enqueue",
                        lambda self, segment, label: send(self, 0, label) if segment == LAYERS - 1 else None)
    results["late-whole"] = layer_race(None, scattered=True)
    record_property("corrupt", {**results, "trials": TRIALS})
    print(f"\nwhole load race, corrupt trials of {TRIALS}: {results}")
    assert results["kvfsm"] == 0
    assert results["no-wait"] > TRIALS // 2
    assert results["late-whole"] > TRIALS // 2
