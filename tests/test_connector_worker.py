"""The connector's worker half on a `SimDevice`: orders in, copies on streams, each job reported once (its loads layer
by layer, and the order a step's jobs go out in: `test_connector_worker_loads.py`).

The scheduler is played by the test (the metadata is written by hand), so each test names exactly the orders
its rule is about; the engine is played by `step`, which calls the worker in the order an engine step does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfsm.config import DiskTierConfig, OffloadConfig
from kvfsm.connector.metadata import ConnectorMetadata, LoadOrder, StoreOrder, WorkerOutput
from kvfsm.connector.refusals import NotRegistered
from kvfsm.connector.worker import WorkerConnector
from kvfsm.executor.layouts import LayoutError
from kvfsm.executor.sim import SimDevice
from kvfsm.executor.transfer import UnknownLayer
from kvfsm.tiers.disk import DiskTierError

NUM_BLOCKS = 8
SHAPE = (2, NUM_BLOCKS, 4, 1, 8)
"""kv-first: (K/V, blocks, tokens per block, heads, head dim)."""


def make_worker(k: int = 1, cpu_blocks: int = 4, layer_stores: bool = False, layer_loads: bool = False,
                num_layers: int = 2) -> tuple[WorkerConnector, SimDevice, list[torch.Tensor]]:
    """A registered worker over `num_layers` layers of distinct, random KV bytes."""
    device = SimDevice()
    worker = WorkerConnector(OffloadConfig(cpu_blocks=cpu_blocks, block_size_factor=k, gpu_block_size=4,
                                           layer_stores=layer_stores, layer_loads=layer_loads), device)
    generator = torch.Generator().manual_seed(7)
    layers = [torch.randn(SHAPE, generator=generator).half() for _ in range(num_layers)]
    worker.register_kv_caches({f"layer.{i}": t for i, t in enumerate(layers)}, "kv-first")
    return worker, device, layers


def step(worker: WorkerConnector, meta: ConnectorMetadata) -> WorkerOutput:
    """The worker's calls of one engine step (the forward pass itself writes nothing here)."""
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions()
    worker.start_load_kv()
    worker.wait_for_save()
    return worker.get_finished()


def blocks(layers: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [layer[:, ids].clone() for layer in layers]


def store(job_id: int, gpu_blocks: tuple[int, ...], cpu_slots: tuple[int, ...]) -> StoreOrder:
    return StoreOrder(job_id=job_id, req_id="r", gpu_blocks=gpu_blocks, cpu_slots=cpu_slots)


# registration ----------------------------------------------------------------------------------------------


def test_a_worker_moves_blocks_with_the_configured_mechanism() -> None:
    worker = WorkerConnector(OffloadConfig(cpu_blocks=4, gpu_block_size=4, mechanism="copy-per-block"), SimDevice())
    worker.register_kv_caches({"layer.0": torch.zeros(SHAPE)}, "kv-first")
    assert worker.transfers.mechanism == "copy-per-block"


@pytest.mark.parametrize("tensors, layout", [
    ({"layer.0": torch.zeros(3, NUM_BLOCKS, 4, 1, 8)}, "kv-first"),  # three planes, not K and V
    ({"layer.0": torch.zeros(SHAPE)}, "paged"),  # no such layout
    ({"layer.0": torch.zeros(SHAPE), "layer.1": torch.zeros(2, NUM_BLOCKS + 1, 4, 1, 8)}, "kv-first"),
    ({"layer.0": torch.zeros(SHAPE).transpose(2, 4)}, "kv-first"),  # not contiguous
])
def test_registering_caches_of_a_bad_layout_or_shape_raises_layout_error(tensors: dict[str, torch.Tensor],
                                                                         layout: str) -> None:
    device = SimDevice()
    worker = WorkerConnector(OffloadConfig(cpu_blocks=2, gpu_block_size=4), device)
    with pytest.raises(LayoutError):
        worker.register_kv_caches(tensors, layout)
    assert device.host_bytes == 0, "a refused registration pinned host memory"


def worker_with_disk_tiers(device: SimDevice, *paths: Path) -> WorkerConnector:
    """A worker whose lower tiers are disk tiers in `paths`, opened in that order when it registers."""
    tiers = [DiskTierConfig(name=f"disk{i}", path=path, capacity_bytes=1 << 20) for i, path in enumerate(paths)]
    return WorkerConnector(OffloadConfig(cpu_blocks=4, gpu_block_size=4, lower_tiers=tiers), device)


def unopenable(tmp_path: Path) -> tuple[Path, Path]:
    """(a file, a tier directory below it): the tier cannot open until the file is removed."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    return blocker, blocker / "tier"


def test_a_registration_whose_tier_cannot_open_leaves_nothing_pinned_and_nothing_open(tmp_path: Path) -> None:
    """The pool is pinned before the tiers open: a tier that then fails unpins it again, and the tiers already
    opened are closed (their slot files gone)."""
    device = SimDevice()
    opened = tmp_path / "opened"
    worker = worker_with_disk_tiers(device, opened, unopenable(tmp_path)[1])
    with pytest.raises(DiskTierError):
        worker.register_kv_caches({"layer.0": torch.zeros(SHAPE)}, "kv-first")
    assert device.host_bytes == 0, "a failed registration left its host pool pinned"
    assert list(opened.iterdir()) == [], "a failed registration left a tier open"
    with pytest.raises(NotRegistered):
        _ = worker.pool


def test_a_failed_registration_can_be_retried_and_the_retry_pins_one_pool(tmp_path: Path) -> None:
    device = SimDevice()
    blocker, path = unopenable(tmp_path)
    worker = worker_with_disk_tiers(device, path)
    with pytest.raises(DiskTierError):
        worker.register_kv_caches({"layer.0": torch.zeros(SHAPE)}, "kv-first")
    blocker.unlink()
    worker.register_kv_caches({"layer.0": torch.zeros(SHAPE)}, "kv-first")
    assert device.host_bytes == worker.pool.registered_bytes == 4 * worker.pool.slot_bytes
    assert [tier.name for tier in worker.lower_tiers] == ["disk0"]
    worker.shutdown()


def test_shutdown_after_failed_registrations_frees_every_host_byte(tmp_path: Path) -> None:
    device = SimDevice()
    worker = worker_with_disk_tiers(device, unopenable(tmp_path)[1])
    for _ in range(2):
        with pytest.raises(DiskTierError):
            worker.register_kv_caches({"layer.0": torch.zeros(SHAPE)}, "kv-first")
    worker.shutdown()
    assert device.host_bytes == 0


def test_orders_before_registration_raise_not_registered() -> None:
    worker = WorkerConnector(OffloadConfig(cpu_blocks=2, gpu_block_size=4), SimDevice())
    with pytest.raises(NotRegistered):
        worker.bind_connector_metadata(ConnectorMetadata(step=1, loads=(
            LoadOrder(job_id=0, req_id="r", gpu_blocks=(0,), cpu_slots=(0,)),)))
    with pytest.raises(NotRegistered):
        _ = worker.pool


def test_a_step_with_no_orders_needs_no_registration() -> None:
    """An engine may step before its caches are registered (or with a connector that has nothing to move)."""
    worker = WorkerConnector(OffloadConfig(cpu_blocks=2, gpu_block_size=4), SimDevice())
    assert step(worker, ConnectorMetadata(step=1)) == WorkerOutput()


# transfers -------------------------------------------------------------------------------------------------


def test_a_store_is_submitted_the_step_after_it_was_ordered_and_reported_once() -> None:
    worker, device, _ = make_worker()
    assert step(worker, ConnectorMetadata(step=1, stores=(store(0, (1, 2), (0, 1)),))) == WorkerOutput()
    device.run_until_idle()
    assert worker.jobs[0].state == "pending-store"
    assert not [a for a in device.accesses if a.actor == "store"], "a store ran in the step that ordered it"
    step(worker, ConnectorMetadata(step=2))
    assert worker.jobs[0].state == "submitted"
    device.run_until_idle()
    assert worker.get_finished().done == (0,)
    assert worker.get_finished() == WorkerOutput(), "a finished job was reported twice"
    assert worker.jobs == {}


def test_a_store_is_checked_and_placed_as_its_forward_ends_so_the_next_step_only_sends_it() -> None:
    worker, device, _ = make_worker()
    planned: list[tuple[int, ...]] = []
    store_chunks = worker.transfers.store_chunks
    worker.transfers.store_chunks = lambda gpu, cpu: planned.append(tuple(gpu)) or store_chunks(gpu, cpu)
    worker.bind_connector_metadata(ConnectorMetadata(step=1, stores=(store(0, (1, 2), (0, 1)),)))
    worker.handle_preemptions()
    worker.start_load_kv()
    assert planned == []
    worker.wait_for_save()
    assert planned == [(1, 2)], "the store was not planned as the forward that writes it ended"
    step(worker, ConnectorMetadata(step=2))
    assert planned == [(1, 2)], "the step that sends the store checked it again"
    device.run_until_idle()
    assert worker.get_finished().done == (0,)


def test_wait_drives_the_device_until_the_jobs_are_done() -> None:
    worker, device, _ = make_worker()
    step(worker, ConnectorMetadata(step=1, stores=(store(0, (1, 2), (0, 1)),)))
    step(worker, ConnectorMetadata(step=2))
    assert not device.idle
    worker.wait([0])
    assert device.idle and worker.get_finished().done == (0,)


@pytest.mark.parametrize("k, gpu_offset, loaded", [(1, 0, 2), (2, 0, 4), (2, 1, 3), (2, 1, 2)])
def test_stored_bytes_load_back_exactly(k: int, gpu_offset: int, loaded: int) -> None:
    """Two CPU blocks of k GPU blocks each; the load starts `gpu_offset` sub-blocks into the first one."""
    worker, device, layers = make_worker(k=k)
    sources = list(range(2 * k))
    expected = blocks(layers, sources[gpu_offset:gpu_offset + loaded])
    step(worker, ConnectorMetadata(step=1, stores=(store(0, tuple(sources), (0, 1)),)))
    step(worker, ConnectorMetadata(step=2))
    device.run_until_idle()
    worker.get_finished()
    targets = tuple(range(NUM_BLOCKS - loaded, NUM_BLOCKS))
    slots = (0, 1) if gpu_offset + loaded > k else (0,)
    step(worker, ConnectorMetadata(step=3, loads=(
        LoadOrder(job_id=1, req_id="r", gpu_blocks=targets, cpu_slots=slots, gpu_offset=gpu_offset),)))
    device.run_until_idle()
    assert worker.get_finished().done == (1,)
    for want, got in zip(expected, blocks(layers, list(targets))):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


# preemption ------------------------------------------------------------------------------------------------


def check_flush_waits_for_stores(worker: WorkerConnector, device: SimDevice) -> None:
    """A preemption flushes one pending and one submitted store: both are done when handle_preemptions returns."""
    step(worker, ConnectorMetadata(step=1, stores=(store(0, (1,), (0,)),)))
    step(worker, ConnectorMetadata(step=2, stores=(store(1, (2,), (1,)),)))
    assert [worker.jobs[j].state for j in (0, 1)] == ["submitted", "pending-store"]
    worker.bind_connector_metadata(ConnectorMetadata(step=3, flush=(0, 1)))
    worker.handle_preemptions()
    assert device.idle, "a flushed store was still queued when the engine could reuse its blocks"
    assert set(worker.get_finished().done) == {0, 1}


def test_handle_preemptions_submits_and_waits_for_flushed_stores() -> None:
    check_flush_waits_for_stores(*make_worker()[:2])
    worker, device, _ = make_worker()
    worker.handle_preemptions = lambda: None  # type: ignore[method-assign]  # control: no flush
    with pytest.raises(AssertionError):
        check_flush_waits_for_stores(worker, device)


# shutdown --------------------------------------------------------------------------------------------------


def test_shutdown_waits_for_transfers_and_releases_the_host_pool() -> None:
    worker, device, _ = make_worker()
    assert device.host_bytes == 4 * worker.pool.slot_bytes
    step(worker, ConnectorMetadata(step=1, stores=(store(0, (1,), (0,)),)))
    step(worker, ConnectorMetadata(step=2))
    worker.shutdown()
    assert device.idle and device.host_bytes == 0
    worker.shutdown()  # twice is harmless


def test_a_layer_hook_naming_an_unregistered_layer_is_refused_before_anything_changes() -> None:
    worker, _, _ = make_worker()
    worker.bind_connector_metadata(ConnectorMetadata(step=1, stores=(store(0, (1,), (0,)),)))
    with pytest.raises(UnknownLayer, match="layer.9"):
        worker.wait_for_layer_load("layer.9")
    with pytest.raises(UnknownLayer, match="layer.9"):
        worker.save_kv_layer("layer.9")
    assert worker.jobs == {}
