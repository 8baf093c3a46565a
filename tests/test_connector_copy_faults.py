"""Copies that fail where real ones can, under a whole engine: when checked, when a step's jobs are merged into one
pipeline, or part-way through sending it (`kvfsm.testing.copy_faults`). A failed copy must end as a failed job the
engine recomputes, and the copies it had already enqueued must finish before its failure is reported or its blocks
are reused.

The copy streams are held back (the device runs them only when nothing else can run), so enqueued copies are still
pending when the engine goes on; staging slots of one or two GPU blocks make a step's stores a pipeline of chunks.
"""

from __future__ import annotations

from typing import Callable

import pytest

from kvfsm.executor.sim import SimDevice
from kvfsm.states import TransferJobState
from kvfsm.testing.copy_faults import STAGES, Direction, Stage
from kvfsm.testing.harness import Harness
from engine_scenarios import PREFIX, Control, mutant

OTHER = tuple(range(40, 58))


def lagging(stream: str) -> Callable[[list[str]], str]:
    """A schedule that runs `stream` only when no other stream can run."""
    return lambda options: next((o for o in options if o != stream), options[0])


def harness(staging_blocks: int = 2, control: Control | None = None, gpu_blocks: int = 24) -> Harness:
    h = Harness(SimDevice(), num_gpu_blocks=gpu_blocks, cpu_blocks=16, staging_blocks=staging_blocks)
    if control is not None:
        control(h)
    return h


def run(h: Harness, steps: int = 6) -> list[str]:
    """Step the engine with the device lagging, checking after every step, then drain and check the outputs."""
    for _ in range(steps):
        h.engine.step()
        found = h.violations()
        if found:
            return found
    h.drain()
    return h.final_violations()


def worker_log(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvfsm.connector.worker"]


def failed_load(h: Harness, stage: Stage, after: int) -> list[str]:
    """A stored prefix returns, and its load fails at `stage`; the load stream lags."""
    h.add_request(PREFIX, 1)
    h.drain()
    h.engine.reset_prefix_cache()
    h.device.scheduler = lagging("load")
    h.add_request(PREFIX, 2)
    h.faults.arm("load", stage, after)
    return run(h)


def failed_store(h: Harness, stage: Stage, after: int, max_new: int = 3) -> list[str]:
    """A request's store fails at `stage`: checked as its prefill's forward ends, merged and sent as the step after
    submits it; another request arrives and may reuse GPU blocks; the store stream lags."""
    h.device.scheduler = lagging("store")
    h.add_request(PREFIX, max_new)
    if stage == "check":
        h.faults.arm("store", stage, after)
    h.engine.step()
    if stage != "check":
        h.faults.arm("store", stage, after)
    h.add_request(OTHER, 2)
    return run(h)


CASES = [(stage, after) for stage in STAGES for after in ((0, 1, 2) if stage == "copy" else (0,))]


@pytest.mark.parametrize(("stage", "after"), CASES)
@pytest.mark.parametrize("direction", ["load", "store"])
def test_a_copy_that_fails_at_any_stage_ends_as_one_failed_job_and_outputs_stay_correct(
        direction: Direction, stage: Stage, after: int) -> None:
    h = harness()
    found = (failed_load if direction == "load" else failed_store)(h, stage, after)
    stats = h.connector.scheduler.stats
    assert found == []
    assert (stats.loads_failed, stats.stores_failed) == ((1, 0) if direction == "load" else (0, 1))


def test_a_load_that_fails_after_some_layers_were_sent_is_reported_only_once_they_landed() -> None:
    assert failed_load(harness(), "copy", after=1) == []


def test_a_load_failure_reported_before_its_sent_layers_landed_is_caught() -> None:
    found = failed_load(harness(control=mutant("fail-without-end-event")), "copy", after=1)
    assert any(line.startswith("load-before-use") for line in found)


def test_a_finished_request_keeps_its_blocks_until_its_part_sent_store_failed() -> None:
    assert failed_store(harness(gpu_blocks=12), "copy", after=2, max_new=1) == []


def test_a_store_failure_reported_before_its_sent_chunks_ran_is_caught() -> None:
    found = failed_store(harness(gpu_blocks=12, control=mutant("fail-without-end-event")), "copy", after=2, max_new=1)
    assert any(line.startswith("fence") for line in found)


def preempted_during_failing_flush(h: Harness, after: int) -> list[str]:
    """A request is preempted under memory pressure while its store is still pending; the flush submits the store,
    and it fails after `after` chunks were sent. Another request arrives meanwhile: the preempted blocks are the
    first handed out again, and the step that takes them rewrites them."""
    h.device.scheduler = lagging("store")
    h.add_request(PREFIX, 3)
    h.engine.step()
    h.faults.arm("store", "copy", after)
    h.engine.preempt(h.engine.running[0].request_id, reclaim=True)
    h.add_request(OTHER, 1)
    return run(h)


@pytest.mark.parametrize("after", [1, 2, 3])
def test_a_flushed_store_that_fails_part_way_is_waited_for_before_its_blocks_are_reused(after: int) -> None:
    assert preempted_during_failing_flush(harness(staging_blocks=1, gpu_blocks=12), after) == []


def test_a_flush_that_skips_a_failed_store_is_caught() -> None:
    control = mutant("flush-skips-failed-stores")
    found = preempted_during_failing_flush(harness(staging_blocks=1, gpu_blocks=12, control=control), 1)
    assert any(line.startswith("fence") for line in found)


def two_stores_in_one_pipeline(stage: Stage, after: int) -> tuple[Harness, dict[int, TransferJobState]]:
    """Two requests' prefills are stored in one step, as one pipeline of one-block chunks, which fails at `stage`."""
    h = harness(staging_blocks=1)
    h.add_request(PREFIX[:8], 3)
    h.add_request(OTHER[:8], 3)
    h.engine.step()
    h.settle()
    h.faults.arm("store", stage, after)
    seen: dict[int, TransferJobState] = {}
    fire = h.connector.scheduler.ledger.fire_job

    def watch(job, trigger, **kwargs):  # type: ignore[no-untyped-def]
        fire(job, trigger, **kwargs)
        if job.kind == "store" and trigger in ("complete", "fail"):
            seen[job.job_id] = job.state
    h.connector.scheduler.ledger.fire_job = watch  # type: ignore[method-assign]
    assert run(h) == []
    return h, seen


def test_a_store_pipeline_refused_when_merged_fails_every_store_in_it() -> None:
    _, seen = two_stores_in_one_pipeline("merge", 0)
    assert sorted(seen.values()) == [TransferJobState.FAILED] * 2


def test_stores_whose_chunks_were_all_sent_before_the_pipeline_broke_complete_the_rest_fail() -> None:
    _, seen = two_stores_in_one_pipeline("copy", 5)  # the first store's four chunks went out, the second's did not
    assert [seen[j] for j in sorted(seen)] == [TransferJobState.DONE, TransferJobState.FAILED]


def test_each_store_chunk_is_logged_under_the_jobs_of_its_pipeline() -> None:
    h = harness(staging_blocks=4)
    h.add_request(PREFIX[:8], 3)
    h.add_request(OTHER[:8], 3)
    h.drain()
    labels = [a.label for a in h.device.accesses if a.actor == "store"]
    assert list(dict.fromkeys(labels)) == ["store jobs 0,1 chunk 0", "store jobs 0,1 chunk 1"]


def test_a_lone_store_chunk_is_logged_under_its_job() -> None:
    h = harness(staging_blocks=8)
    h.add_request(PREFIX[:8], 3)
    h.drain()
    assert {a.label for a in h.device.accesses if a.actor == "store"} == {"store job 0 chunk 0"}


@pytest.mark.parametrize(("stage", "after"), CASES)
@pytest.mark.parametrize("direction", ["load", "store"])
def test_a_copy_failed_at_submission_is_logged_naming_its_job_and_the_error(
        direction: Direction, stage: Stage, after: int, caplog: pytest.LogCaptureFixture) -> None:
    h = harness()
    assert (failed_load if direction == "load" else failed_store)(h, stage, after) == []
    job = 1 if direction == "load" else 0  # job 0 stored the prefix the load returns to
    logged = worker_log(caplog)
    assert len(logged) == 1
    assert logged[0].startswith(f"{direction} job {job} failed at submission: InjectedFault: injected {direction} failure")


class EndEventLost(RuntimeError):
    """The device could not record a job's end event."""


def test_a_store_whose_end_event_cannot_be_recorded_fails_logged_and_is_recomputed(
        caplog: pytest.LogCaptureFixture) -> None:
    h = harness()
    h.add_request(PREFIX, 3)
    h.engine.step()
    record, lost = h.device.record, []

    def record_unless_store_end(stream, event):  # type: ignore[no-untyped-def]
        if stream == "store" and not lost:
            lost.append(event)
            raise EndEventLost("no event")
        record(stream, event)
    h.device.record = record_unless_store_end  # type: ignore[method-assign]
    assert run(h) == []
    assert lost and h.connector.scheduler.stats.stores_failed == 1
    assert worker_log(caplog) == [
        "store job 0: no end event could be recorded: no event"]


@pytest.mark.parametrize(("stage", "after"), [("check", 0), ("copy", 0), ("copy", 1)])
def test_a_per_layer_store_that_fails_ends_as_one_failed_job_logged_and_outputs_stay_correct(
        stage: Stage, after: int, caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(SimDevice(), num_gpu_blocks=24, cpu_blocks=16, per_layer=True, layer_stores=True)
    h.device.scheduler = lagging("store")
    h.faults.arm("store", stage, after)
    h.add_request(PREFIX, 3)  # its store goes out layer by layer during its prefill, and fails
    h.add_request(OTHER, 2)
    assert run(h) == []
    assert h.connector.scheduler.stats.stores_failed == 1
    logged = worker_log(caplog)
    assert len(logged) == 1 and logged[0].startswith("store job 0 failed at submission: InjectedFault: injected store")
