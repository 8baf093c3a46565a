"""Any exception while a transfer is submitted ends as a failed job the engine recomputes; the worker serves on.

vLLM's workers report `False` per transfer for the same reason: a worker that let one unexpected exception
leave a job `submitted` with no event would raise on every later `get_finished` and stop serving.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvfsm.connector.metadata import ConnectorMetadata, LoadOrder, WorkerOutput
from kvfsm.connector.worker import WorkerConnector
from test_connector_worker import make_worker, step, store

FAULTS: dict[str, Callable[[], BaseException]] = {
    "runtime error": lambda: RuntimeError("injected"),
    "CUDA error": lambda: torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    "host memory error": lambda: MemoryError("cannot allocate pinned host memory"),
}


def fail_next(worker: WorkerConnector, method: str, fault: BaseException, enqueue_first: bool = False) -> None:
    """Make the next `method` call of the worker's transfers raise `fault` (after enqueueing its first layer
    segment, if asked: `method` is then "load_segments")."""
    real = getattr(worker.transfers, method)

    def broken(*args: object, **kwargs: object) -> None:
        setattr(worker.transfers, method, real)
        if enqueue_first:
            real(*args, **kwargs).enqueue(0, "a layer enqueued before the failure")
        raise fault

    setattr(worker.transfers, method, broken)


def load(job_id: int, gpu_blocks: tuple[int, ...], cpu_slots: tuple[int, ...]) -> LoadOrder:
    return LoadOrder(job_id=job_id, req_id="r", gpu_blocks=gpu_blocks, cpu_slots=cpu_slots)


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_a_store_that_raises_ends_as_a_failed_job_and_the_worker_serves_on(fault: str) -> None:
    worker, device, _ = make_worker()
    fail_next(worker, "store_chunks", FAULTS[fault]())
    step(worker, ConnectorMetadata(step=1, stores=(store(0, (1,), (0,)),)))
    step(worker, ConnectorMetadata(step=2, stores=(store(1, (2,), (1,)),)))
    device.run_until_idle()
    assert worker.get_finished() == WorkerOutput(failed=(0,))
    step(worker, ConnectorMetadata(step=3))
    device.run_until_idle()
    assert worker.get_finished() == WorkerOutput(done=(1,)), "the worker stopped serving after a failed store"
    assert worker.jobs == {}


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_a_load_that_raises_ends_as_a_failed_job_and_the_worker_serves_on(fault: str) -> None:
    worker, device, _ = make_worker()
    fail_next(worker, "load_segments", FAULTS[fault]())
    step(worker, ConnectorMetadata(step=1, loads=(load(0, (3,), (0,)),)))
    device.run_until_idle()
    assert worker.get_finished() == WorkerOutput(failed=(0,))
    step(worker, ConnectorMetadata(step=2, loads=(load(1, (4,), (1,)),)))
    device.run_until_idle()
    assert worker.get_finished() == WorkerOutput(done=(1,)), "the worker stopped serving after a failed load"
    assert worker.jobs == {}


def test_a_failed_job_is_reported_only_after_the_copies_it_enqueued_ran() -> None:
    """A load that raised after enqueueing copies may still write its GPU blocks: the engine must not recompute
    them (on the compute stream) before those copies ended, so the failure is reported only then."""
    worker, device, _ = make_worker()
    fail_next(worker, "load_segments", RuntimeError("injected after enqueue"), enqueue_first=True)
    assert step(worker, ConnectorMetadata(step=1, loads=(load(0, (3,), (0,)),))) == WorkerOutput()
    device.run_until_idle()
    assert worker.get_finished() == WorkerOutput(failed=(0,))
    assert worker.get_finished() == WorkerOutput(), "a failed job was reported twice"
