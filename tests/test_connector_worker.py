"""The connector's worker half on a `SimDevice`: orders in, copies on streams, each job reported once.

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
from kvfsm.connector.turns import send_in_turns
from kvfsm.connector.worker import WorkerConnector
from kvfsm.executor.layouts import LayoutError, allocate_kv_caches
from kvfsm.executor.sim import SimDevice
from kvfsm.executor.transfer import UnknownLayer
from kvfsm.tiers.disk import DiskTierError
from kvfsm.testing.copy_faults import FaultInjector
from test_connector_copy_faults import lagging

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


def start_one_load(worker: WorkerConnector, fail_after: int | None = None) -> None:
    """Order one load of GPU block 3 from CPU slot 0 and send it; with `fail_after`, it fails after sending that
    many layer segments."""
    if fail_after is not None:
        faults = FaultInjector(worker._transfers)
        faults.arm("load", "copy" if fail_after else "check", fail_after)
        worker._transfers = faults  # type: ignore[assignment]
    worker.bind_connector_metadata(ConnectorMetadata(step=1, loads=(LoadOrder(
        job_id=0, req_id="r", gpu_blocks=(3,), cpu_slots=(0,)),)))
    worker.start_load_kv()


def land_segments(device: SimDevice, count: int) -> None:
    """Run the compute barrier, then the load stream up to (not into) load 0's segment of layer `count`: `count`
    segments landed (all of them, where the load has no more)."""
    device.run_one("compute")
    while device._queues["load"] and [op.label for op in device._queues["load"]][:1] != [f"load job 0 layer {count}"]:
        device.run_one("load")


def test_a_load_lands_one_segment_per_layer_and_completes_only_after_the_last() -> None:
    worker, device, _ = make_worker()
    start_one_load(worker)
    land_segments(device, 1)
    assert worker.get_finished() == WorkerOutput() and worker.jobs[0].landed_segments == 1
    device.run_until_idle()
    assert worker.get_finished() == WorkerOutput(done=(0,))


@pytest.mark.parametrize("landed", range(5))
def test_a_report_counts_exactly_the_segments_that_landed(landed: int) -> None:
    """Over four layers, whichever of them landed: the report asks the newest segment first and, that not done,
    walks the earlier ones, so a walk that stopped short or skipped one would count segments still copying."""
    worker, device, _ = make_worker(num_layers=4)
    start_one_load(worker)
    land_segments(device, landed)
    reported = worker.get_finished()
    if landed == 4:
        assert reported == WorkerOutput(done=(0,))
    else:
        assert reported == WorkerOutput() and worker.jobs[0].landed_segments == landed


@pytest.mark.parametrize(("layer", "may_compute"), [("layer.0", True), ("layer.1", False)])
def test_a_layer_computes_once_its_own_segment_landed_not_the_whole_load(layer: str, may_compute: bool) -> None:
    worker, device, _ = make_worker(layer_loads=True)
    start_one_load(worker)
    worker.wait_for_layer_load(layer)
    land_segments(device, 1)
    assert ("compute" in device.runnable()) is may_compute


def test_a_layer_whose_segment_a_failed_load_never_sent_waits_for_the_segments_it_did_send() -> None:
    worker, device, _ = make_worker(layer_loads=True)
    start_one_load(worker, fail_after=1)
    worker.wait_for_layer_load("layer.1")
    device.run_one("compute")  # the load's barrier; what is left on compute is the hook's wait
    assert [op.label for op in device._queues["compute"]] == ["wait on compute"]
    assert "compute" not in device.runnable()  # layer 0's segment may still write the request's blocks
    while device._queues["load"]:
        device.run_one("load")
    assert "compute" in device.runnable()
    assert worker.get_finished() == WorkerOutput(failed=(0,))


def test_a_failed_load_whose_end_could_not_be_recorded_leaves_the_layer_hooks_nothing_to_wait_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that cannot record the failed load's end (a CUDA error) leaves no event: the hook goes on."""
    worker, device, _ = make_worker(layer_loads=True)
    record = device.record

    def record_or_fail_on_load(stream: str, event: object) -> None:
        if stream == "load":
            raise RuntimeError("the device cannot record")
        record(stream, event)

    monkeypatch.setattr(device, "record", record_or_fail_on_load)
    start_one_load(worker, fail_after=0)
    worker.wait_for_layer_load("layer.0")
    assert "wait on compute" not in [op.label for op in device._queues["compute"]]
    assert worker.get_finished() == WorkerOutput(failed=(0,))


def test_a_failed_load_whose_end_could_not_be_recorded_is_reported_once_its_last_recorded_segment_ran(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The device recorded layer 0's event, then could record nothing more: the load fails, and the failure may
    reach the engine (which recomputes the blocks) only once what that event follows ran, not at once."""
    worker, device, _ = make_worker()
    record, recorded = device.record, []

    def record_only_the_first_on_load(stream: str, event: object) -> None:
        if stream == "load":
            if recorded:
                raise RuntimeError("the device cannot record")
            recorded.append(event)
        record(stream, event)

    monkeypatch.setattr(device, "record", record_only_the_first_on_load)
    start_one_load(worker)
    assert worker.get_finished() == WorkerOutput()  # layer 0's copy may still write the request's blocks
    device.run_until_idle()
    assert worker.get_finished() == WorkerOutput(failed=(0,))


def stored_slots(worker: WorkerConnector, device: SimDevice, sources: tuple[int, ...]) -> None:
    """Store GPU blocks `sources` into CPU slots 0.. and let the stores land."""
    step(worker, ConnectorMetadata(step=1, stores=(store(0, sources, tuple(range(len(sources)))),)))
    step(worker, ConnectorMetadata(step=2))
    device.run_until_idle()
    worker.get_finished()


def test_a_steps_loads_go_out_together_one_segment_per_layer_and_land_exactly() -> None:
    worker, device, layers = make_worker()
    stored_slots(worker, device, (0, 1))
    expected = blocks(layers, [0, 1])
    worker.bind_connector_metadata(ConnectorMetadata(step=3, loads=(
        LoadOrder(job_id=1, req_id="a", gpu_blocks=(6,), cpu_slots=(0,)),
        LoadOrder(job_id=2, req_id="b", gpu_blocks=(7,), cpu_slots=(1,)))))
    worker.start_load_kv()
    assert [op.label for op in device._queues["load"] if "layer" in op.label] == [
        "load jobs 1,2 layer 0", "load jobs 1,2 layer 1"]
    device.run_until_idle()
    assert worker.get_finished().done == (1, 2)
    for want, got in zip(expected, blocks(layers, [6, 7])):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


def test_a_report_of_a_steps_ended_loads_asks_only_their_shared_last_segment_event(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's loads land one event per layer segment for all of them, in stream order: once the last is done
    every earlier one is, so a report asks the device once (a query costs host time on the step's edge), not
    once per segment or per job, and still reports every job."""
    worker, device, _ = make_worker()
    stored_slots(worker, device, (0, 1, 2))
    worker.bind_connector_metadata(ConnectorMetadata(step=3, loads=tuple(
        LoadOrder(job_id=j, req_id=f"r{j}", gpu_blocks=(5 + j,), cpu_slots=(j,)) for j in range(3))))
    worker.start_load_kv()
    device.run_until_idle()
    asked: list[object] = []
    query = device.query
    monkeypatch.setattr(device, "query", lambda event: asked.append(event) or query(event))
    assert worker.get_finished().done == (0, 1, 2)
    assert len(asked) == 1, "one query, of the last layer's segment event"


def test_a_segment_that_lands_while_a_report_walks_its_job_is_counted_by_the_next_report(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A report asks a job's newest segment event first and, finding it not done, counts the landed ones from the
    oldest. Should the newest land in between, the walk still ends at it: the segments before it are counted
    now, the newest by the next report (asking it again there found it done, and the walk ran out)."""
    worker, device, _ = make_worker()
    start_one_load(worker)
    device.run_until_idle()
    query, first = device.query, [True]

    def lands_after_the_first_ask(event: object) -> bool:
        if first[0]:
            first[0] = False
            return False
        return query(event)

    monkeypatch.setattr(device, "query", lands_after_the_first_ask)
    assert worker.get_finished().done == ()
    job = worker.jobs[0]
    assert job.landed_segments == job.segments - 1
    assert worker.get_finished().done == (0,)


def test_on_a_one_segment_cache_the_first_load_is_reported_while_the_next_still_copies() -> None:
    """A cross-layer cache is one segment per job: sent together, a step's loads would share one event, and the
    first request would hear of its load only once the last one landed."""
    device = SimDevice()
    worker = WorkerConnector(OffloadConfig(cpu_blocks=4, gpu_block_size=4), device)
    tensors, groups = allocate_kv_caches("cross-layer", 2, NUM_BLOCKS, 4, 1, 8, torch.float16, "cpu")
    worker.register_kv_caches(tensors, "cross-layer", groups)
    assert worker.transfers.num_segments == 1
    loads = tuple(LoadOrder(job_id=j, req_id=f"r{j}", gpu_blocks=(j + 1,), cpu_slots=(j,)) for j in range(2))
    worker.bind_connector_metadata(ConnectorMetadata(step=1, loads=loads))
    worker.handle_preemptions()
    worker.start_load_kv()
    worker.wait([0])
    assert worker.get_finished().done == (0,), "the first load was held until the step's last one landed"
    device.run_until_idle()
    assert worker.get_finished().done == (1,)


def test_a_load_from_fragmented_slots_goes_out_whole_alone_and_the_steps_others_a_layer_at_a_time() -> None:
    """Sent together, the fragmented load would take the step's other loads whole with it: their layers would wait
    for every byte of the step."""
    worker, device, layers = make_worker()
    stored_slots(worker, device, (0, 1, 2, 3))
    expected = blocks(layers, [3, 0, 1, 2])
    worker.bind_connector_metadata(ConnectorMetadata(step=3, loads=(
        LoadOrder(job_id=1, req_id="a", gpu_blocks=(4, 5), cpu_slots=(3, 0)),
        LoadOrder(job_id=2, req_id="b", gpu_blocks=(6, 7), cpu_slots=(1, 2)))))
    worker.start_load_kv()
    assert [op.label for op in device._queues["load"] if "layer" in op.label] == [
        "load job 2 layer 0", "load job 2 layer 1", "load job 1 layer 0"]
    device.run_until_idle()
    assert {(a.label, a.layer) for a in device.accesses if a.space == "gpu" and a.mode == "write"} == {
        ("load job 2 layer 0", 0), ("load job 2 layer 1", 1), ("load job 1 layer 0", None)}
    assert worker.get_finished().done == (1, 2)
    for want, got in zip(expected, blocks(layers, [4, 5, 6, 7])):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


def test_loads_into_the_same_gpu_block_go_out_one_job_at_a_time() -> None:
    worker, device, _ = make_worker()
    stored_slots(worker, device, (0, 1))
    worker.bind_connector_metadata(ConnectorMetadata(step=3, loads=(
        LoadOrder(job_id=1, req_id="a", gpu_blocks=(6,), cpu_slots=(0,)),
        LoadOrder(job_id=2, req_id="b", gpu_blocks=(6,), cpu_slots=(1,)))))
    worker.start_load_kv()
    assert [op.label for op in device._queues["load"] if "layer" in op.label] == [
        "load job 1 layer 0", "load job 1 layer 1", "load job 2 layer 0", "load job 2 layer 1"]


def test_two_directions_are_sent_in_turns_each_at_about_the_same_share_of_its_bytes() -> None:
    """Stores of 4 x 2 bytes against loads of 2 x 8: whichever direction has sent the smaller share of its bytes
    goes next, the smaller piece first on a tie, so both copy engines start early and finish together."""
    sent: list[str] = []
    stores = [(2, lambda i=i: sent.append(f"s{i}")) for i in range(4)]
    loads = [(8, lambda i=i: sent.append(f"l{i}")) for i in range(2)]
    send_in_turns(stores, loads)
    assert sent == ["s0", "l0", "s1", "s2", "l1", "s3"]



def test_a_load_into_a_gpu_block_a_store_still_reads_waits_for_that_store_even_when_the_store_lags() -> None:
    """The scheduler never orders this (the fence holds such a block), so this is the worker's own defence: the
    store must copy out the block's old bytes before the load overwrites them."""
    worker, device, layers = make_worker()
    stored_slots(worker, device, (0,))
    before = blocks(layers, [2])
    step(worker, ConnectorMetadata(step=3, stores=(store(1, (2,), (1,)),)))
    device.scheduler = lagging("store")
    step(worker, ConnectorMetadata(step=4, loads=(LoadOrder(job_id=2, req_id="b", gpu_blocks=(2,), cpu_slots=(0,)),)))
    device.run_until_idle()
    assert worker.get_finished() == WorkerOutput(done=(1, 2))
    step(worker, ConnectorMetadata(step=5, loads=(LoadOrder(job_id=3, req_id="c", gpu_blocks=(5,), cpu_slots=(1,)),)))
    device.run_until_idle()
    for want, got in zip(before, blocks(layers, [5])):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


def test_stores_into_one_cpu_slot_go_out_one_pipeline_each_and_both_land() -> None:
    """Never ordered by the scheduler; merged into one pipeline they would be refused as writing a slot twice."""
    worker, device, _ = make_worker()
    step(worker, ConnectorMetadata(step=1, stores=(store(0, (1,), (0,)), store(1, (2,), (0,)))))
    step(worker, ConnectorMetadata(step=2))
    device.run_until_idle()
    assert worker.get_finished() == WorkerOutput(done=(0, 1))


def test_shutting_down_waits_for_every_layer_segment_of_a_load_in_flight() -> None:
    """The host pool is unpinned at shutdown: no copy may still read it."""
    worker, device, _ = make_worker()
    stored_slots(worker, device, (0,))
    worker.bind_connector_metadata(ConnectorMetadata(step=3, loads=(
        LoadOrder(job_id=1, req_id="a", gpu_blocks=(6,), cpu_slots=(0,)),)))
    worker.start_load_kv()
    worker.shutdown()
    assert [op.label for op in device._queues["load"]] == []
