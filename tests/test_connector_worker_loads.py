"""The worker half's loads on a `SimDevice`, segment by segment per layer (what a report counts, what a failed load
leaves the layer hooks to wait for), and the order a step's jobs go out in: loads together or alone, in turns with
stores, each behind the copies it must follow. Helpers are `test_connector_worker`'s."""

from __future__ import annotations

import pytest
import torch

from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import ConnectorMetadata, LoadOrder, WorkerOutput
from kvfsm.connector.turns import send_in_turns
from kvfsm.connector.worker import WorkerConnector
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.sim import SimDevice
from kvfsm.testing.copy_faults import FaultInjector
from test_connector_copy_faults import lagging
from test_connector_worker import NUM_BLOCKS, blocks, make_worker, step, store


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
    while (queued := device.queued()["load"]) and queued[0] != f"load job 0 layer {count}":
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
    assert device.queued()["compute"] == ["wait on compute"]
    assert "compute" not in device.runnable()  # layer 0's segment may still write the request's blocks
    while device.queued()["load"]:
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
    assert "wait on compute" not in device.queued()["compute"]
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
    assert [label for label in device.queued()["load"] if "layer" in label] == [
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
    assert [label for label in device.queued()["load"] if "layer" in label] == [
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
    assert [label for label in device.queued()["load"] if "layer" in label] == [
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
    assert device.queued()["load"] == []
