"""The worker half's per-layer stores (`save_kv_layer`), driven directly on a `SimDevice`: when they go out, when they
are reported, what a refused one leaves behind, and that the worker forgets a job once it reported it."""

from __future__ import annotations

import pytest
import torch

from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import ConnectorMetadata, LoadOrder, WorkerOutput
from kvfsm.connector.refusals import NotRegistered
from kvfsm.connector.worker import WorkerConnector
from kvfsm.executor.sim import SimDevice
from kvfsm.testing.copy_faults import FaultInjector
from test_connector_worker import make_worker, store

LAYERS = ("layer.0", "layer.1")
"""The layers `make_worker` registers."""


def forward(worker: WorkerConnector, meta: ConnectorMetadata, saved: tuple[str, ...] = LAYERS) -> WorkerOutput:
    """One engine step whose forward calls `save_kv_layer` after each layer of `saved`; the device then runs."""
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions()
    worker.start_load_kv()
    for layer in saved:
        worker.save_kv_layer(layer)
    worker.wait_for_save()
    worker.device.run_until_idle()  # type: ignore[attr-defined]
    return worker.get_finished()


def test_a_per_layer_store_is_reported_only_from_the_step_after_it_was_ordered() -> None:
    """The scheduler moves it to submitted as the next step starts; a report in its own step would precede that."""
    worker, _, _ = make_worker(layer_stores=True)
    assert forward(worker, ConnectorMetadata(step=1, stores=(store(0, (2,), (0,)),))).done == ()
    assert forward(worker, ConnectorMetadata(step=2)).done == (0,)


def test_layers_the_engine_did_not_save_go_out_when_the_forward_ends() -> None:
    worker, device, layers = make_worker(layer_stores=True)
    forward(worker, ConnectorMetadata(step=1, stores=(store(0, (3,), (1,)),)), saved=("layer.0",))
    assert forward(worker, ConnectorMetadata(step=2)).done == (0,)
    slot = worker.pool.buffer[worker.pool.slot_bytes:2 * worker.pool.slot_bytes]
    expected = torch.cat([layer[:, 3].contiguous().view(torch.uint8).reshape(-1) for layer in layers])
    assert sorted(slot.tolist()) == sorted(expected.tolist())
    assert {a.layer for a in device.accesses if a.actor == "store" and a.space == "gpu"} == {0, 1}


def test_without_layer_stores_save_kv_layer_sends_nothing() -> None:
    worker, device, _ = make_worker(layer_stores=False)
    worker.bind_connector_metadata(ConnectorMetadata(step=1, stores=(store(0, (2,), (0,)),)))
    worker.handle_preemptions()
    worker.start_load_kv()
    for layer in LAYERS:
        worker.save_kv_layer(layer)
    assert not device.queued()["store"], "a store went out before the forward ended"


def test_a_per_layer_store_refused_when_checked_leaves_the_steps_other_stores_to_go_out() -> None:
    worker, _, _ = make_worker(layer_stores=True)
    faults = FaultInjector(worker._transfers)
    worker._transfers = faults  # type: ignore[assignment]
    faults.arm("store")
    forward(worker, ConnectorMetadata(step=1, stores=(store(0, (2,), (0,)), store(1, (3,), (1,)))))
    out = forward(worker, ConnectorMetadata(step=2))
    assert (out.done, out.failed) == ((1,), (0,))


def test_a_worker_forgets_every_job_it_reported() -> None:
    worker, _, _ = make_worker(layer_stores=False)
    forward(worker, ConnectorMetadata(step=1, stores=(store(0, (2,), (0,)), store(1, (3,), (1,)))))
    forward(worker, ConnectorMetadata(step=2, loads=(
        LoadOrder(job_id=2, req_id="r2", gpu_blocks=(5,), cpu_slots=(0,)),)))
    forward(worker, ConnectorMetadata(step=3))
    assert worker.jobs == {}
    assert (worker.events.jobs(), worker._stores._planned, worker.events._segments) == ([], {}, {})


def test_a_layer_hook_before_registration_is_refused_as_not_registered() -> None:
    worker = WorkerConnector(OffloadConfig(cpu_blocks=4, gpu_block_size=4, layer_stores=True), SimDevice())
    for hook in (worker.save_kv_layer, worker.wait_for_layer_load):
        with pytest.raises(NotRegistered):
            hook("layer.0")
