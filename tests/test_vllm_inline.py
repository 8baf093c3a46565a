"""Per-layer loads under vLLM's real Scheduler (`layer_loads`): a CPU hit is computed in the step that loads it.

One rule per test, each with its control caught. With vLLM's scheduling synchronous, a request with an inline load
is in `loading-inline` until its load is reported, in the output of the load's step: vLLM may finish it in that
output first (`inline-load-outlives-request`), and preempts or aborts it only after; a failed inline load is reported
in its own step's output, so vLLM withholds that step's token and recomputes exactly the blocks that did not land
(`inline-load-in-step`). Under async scheduling no load is inline (tests/test_vllm_inline_async.py). Every run is
traced against the spec, checked with kvfsm's named invariants each step and required drained. Skipped when vLLM is
not installed.
"""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

import kvfsm.connector.scheduler as scheduler_module  # noqa: E402
from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker  # noqa: E402
from kvfsm.spec import SpecError  # noqa: E402
from kvfsm.states import RequestState  # noqa: E402
from kvfsm.testing.spec_mutants import load_mutant, spec_mutants  # noqa: E402
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import PREFIX, loads_of, make_driver, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm

INLINE = {"layer_loads": True}
SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def load_step(d: Driver, req_id: str) -> int:
    (order,) = loads_of(d, req_id)
    return next(log.step for log in d.log if order in log.orders.loads)


class RequestStates:
    """The request states the adapter's machines move each request through, in order."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = {}

    def __call__(self, lifecycle: str, model, source: str, trigger: str, dest: str) -> None:
        if lifecycle == "request":
            self.seen.setdefault(model.req_id, []).append(dest)

    def after(self, req_id: str, state: str) -> list[str]:
        """`req_id`'s states after its first visit to `state`."""
        states = self.seen[req_id]
        return states[states.index(state) + 1:]


@pytest.fixture
def states(make_driver) -> Iterator[Callable[[Driver], RequestStates]]:
    """Watches a driver's request states until the test ends."""
    watched: list[tuple[Driver, RequestStates]] = []

    def watch(d: Driver) -> RequestStates:
        recorder = RequestStates()
        d.connector.scheduler_side.kvfsm.machines.observe(recorder)
        watched.append((d, recorder))
        return recorder

    yield watch
    for d, recorder in watched:
        d.connector.scheduler_side.kvfsm.machines.unobserve(recorder)


def reload(d: Driver, max_tokens: int = 2) -> int:
    """A stored prefix comes back for `reader`; the step its load went out."""
    store_prefix(d)
    d.add("reader", PREFIX + [1], max_tokens=max_tokens)
    d.run()
    return load_step(d, "reader")


# --- an inline hit --------------------------------------------------------------------------------------------


def test_inline_hit_is_computed_in_the_step_that_loads_it(make_driver, states) -> None:
    d = make_driver(**INLINE)
    seen = states(d)
    step = reload(d)
    assert d.first_token["reader"] == step == d.arrived["reader"] + 1
    assert RequestState.LOADING_INLINE in seen.seen["reader"]
    stats = d.connector.scheduler_side.kvfsm.stats
    assert (stats.loads_inline, stats.loads_async) == (1, 0)
    assert d.cpu_pool_drained()


@SCHEDULING
def test_control_an_asynchronous_hit_computes_a_step_later(make_driver, async_scheduling: bool) -> None:
    """Computed once its load is reported: a step later, two under async scheduling (the report of the load's step
    is processed only after the next step was scheduled)."""
    d = make_driver(async_scheduling=async_scheduling)
    step = reload(d)
    assert d.first_token["reader"] == step + 1 + async_scheduling


def test_inline_hit_reloads_the_writers_bytes_layer_by_layer(make_driver) -> None:
    d = make_driver(AdapterWorker, gpu_blocks=32, cpu_blocks=16, **INLINE)
    store_prefix(d)
    for cache in d.worker.caches.values():
        cache.zero_()  # whatever the reader finds now came from the CPU pool
    d.add("reader", PREFIX + [2])
    d.run()
    (load,) = loads_of(d, "reader")
    for i, block in enumerate(load.gpu_blocks):
        assert d.worker.block_tokens(block) == [t % 251 for t in PREFIX[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]
    assert d.first_token["reader"] == load_step(d, "reader")


# --- preempted, finished, aborted -------------------------------------------------------------------------------


HOG_BLOCKS = 3


def preempted_after_inline_load(d: Driver) -> None:
    """`hog` fills its blocks exactly and needs one more for its first decode; `reader` (admitted after it, in the
    same step, with an inline load) took the last free blocks, so vLLM preempts `reader` the next step (once it has
    read the load's step's output, which reported the load)."""
    store_prefix(d)
    d.add("hog", [900 + t for t in range(HOG_BLOCKS * BLOCK_SIZE)], max_tokens=4)
    d.add("reader", PREFIX + [1], max_tokens=4)
    d.run()
    preempted = {source for lifecycle, source, trigger, dest in d.checks.trace.edges
                 if (lifecycle, trigger, dest) == ("request", "preempt", RequestState.PREEMPTED)}
    assert preempted, "vLLM's preemption of reader never reached kvfsm's request lifecycle"


def test_inline_hit_preempted_the_next_step_was_reported_before(make_driver, states) -> None:
    d = make_driver(gpu_blocks=HOG_BLOCKS + 5 + 1, **INLINE)
    seen = states(d)
    preempted_after_inline_load(d)
    after = seen.after("reader", RequestState.LOADING_INLINE)
    assert after[:2] == [RequestState.RUNNING, RequestState.PREEMPTED]
    assert d.first_token.keys() >= {"hog", "reader"}
    assert d.cpu_pool_drained()


def test_control_a_load_in_flight_under_a_released_request_breaks_its_rule(make_driver) -> None:
    """The rule's check can fail: under async scheduling the load of the step just run is still in flight (an
    asynchronous one there); a request let go behind the machines with its load's slots unpinned is named by
    `inline-load-outlives-request`."""
    d = make_driver(async_scheduling=True, **INLINE)
    store_prefix(d)
    d.add("reader", PREFIX + [1], max_tokens=4)
    d.step()
    kvfsm = d.connector.scheduler_side.kvfsm
    (load,) = [job for job in kvfsm.jobs.values() if job.kind == "load" and job.in_flight]
    kvfsm.requests["reader"].state = RequestState.RELEASED
    for slot in load.cpu_slots:
        kvfsm.manager.blocks[slot].readers = 0
    found = d.checks.violations()["inline-load-outlives-request"]
    assert any("while its request reader is released" in line for line in found)
    assert any("are not pinned" in line for line in found)


def test_request_finished_in_its_inline_load_step_drains_until_the_load_is_reported(make_driver, states) -> None:
    d = make_driver(**INLINE)
    seen = states(d)
    step = reload(d, max_tokens=1)
    assert d.first_token["reader"] == step
    assert seen.after("reader", RequestState.LOADING_INLINE) == [RequestState.DRAINING, RequestState.RELEASED]
    assert "reader" not in d.scheduler.requests
    assert d.cpu_pool_drained()


def test_control_a_finish_not_passed_on_leaves_the_inline_hit_unreleased(make_driver, monkeypatch) -> None:
    d = make_driver(**INLINE)
    side = d.connector.scheduler_side
    original = side.request_finished
    monkeypatch.setattr(side, "request_finished",
                        lambda request: (False, None) if request.request_id == "reader" else original(request))
    with pytest.raises(SpecViolation, match="drained: request reader is running"):
        reload(d, max_tokens=1)


def aborted_after_its_inline_load(d: Driver) -> None:
    store_prefix(d)
    d.add("reader", PREFIX + [1], max_tokens=4)
    d.step()  # its load's step, whose output reported the load
    d.scheduler.finish_requests("reader", RequestStatus.FINISHED_ABORTED)
    d.run()


def test_abort_after_an_inline_hit_releases_it_and_its_blocks(make_driver, states) -> None:
    d = make_driver(**INLINE)
    seen = states(d)
    aborted_after_its_inline_load(d)
    assert seen.after("reader", RequestState.LOADING_INLINE)[0] == RequestState.RUNNING
    assert seen.seen["reader"][-1] == RequestState.RELEASED
    assert "reader" not in d.scheduler.requests
    assert d.cpu_pool_drained()


# --- a failed inline load ---------------------------------------------------------------------------------------


def failed_inline_load(d: Driver) -> tuple[int, int]:
    """`half` reloads the prefix's first two blocks (vLLM's GPU prefix cache then holds them); `reader`'s inline
    load of the other two fails. Returns the step of that load and the tokens `reader` computes from next."""
    store_prefix(d)
    d.add("half", PREFIX[:2 * BLOCK_SIZE] + [5], max_tokens=1)
    d.run()
    d.add("reader", PREFIX + [1], max_tokens=2)
    d.run()
    step = load_step(d, "reader")
    again = next(log.computed.get("reader") for log in d.log if log.step == step + 1)
    return step, again


def test_failed_inline_load_recomputes_exactly_its_blocks_and_withholds_that_steps_token(make_driver) -> None:
    d = make_driver(FakeWorker(fail_loads={"reader"}), **INLINE)
    step, again = failed_inline_load(d)
    (load,) = loads_of(d, "reader")
    assert len(load.gpu_blocks) == 2
    assert again == 2 * BLOCK_SIZE  # vLLM resumes it the next step from the first block that did not land
    assert d.first_token["reader"] > step
    assert d.connector.scheduler_side.kvfsm.stats.loads_failed == 1
    assert d.cpu_pool_drained()


def test_control_failed_inline_load_whose_blocks_are_not_named_emits_a_token_on_garbage(make_driver) -> None:
    d = make_driver(FakeWorker(fail_loads={"reader"}, report_invalid_blocks=False), **INLINE)
    step, _ = failed_inline_load(d)
    assert d.first_token["reader"] == step


def test_control_an_inline_load_reported_a_step_late_is_caught(make_driver) -> None:
    """A worker that reports its step's loads in the next step's output (the adapter's worker waits for them)."""
    d = make_driver(FakeWorker(load_steps=2), **INLINE)
    with pytest.raises(SpecViolation, match="inline-load-in-step"):
        reload(d)


# --- deferral stays convoy-free ---------------------------------------------------------------------------------


def sharers(d: Driver) -> None:
    """`second` asks for the prefix `first` loads inline in this very step."""
    store_prefix(d)
    d.add("first", PREFIX + [1])
    d.add("second", PREFIX + [2])
    d.run()


def test_a_sharer_of_an_inline_load_computes_on_it_in_the_same_step(make_driver) -> None:
    """vLLM caches a synchronously loaded block at allocation: the sharer reads it behind the same layer waits."""
    d = make_driver(**INLINE)
    sharers(d)
    assert not loads_of(d, "second")
    assert d.first_token["second"] == d.first_token["first"] == load_step(d, "first")


@SCHEDULING
def test_a_sharer_deferred_behind_an_inline_load_waits_only_until_that_step_ends(make_driver,
                                                                                async_scheduling: bool) -> None:
    """Without vLLM's prefix cache the sharer meets the load's slots and is deferred: it proceeds with the first
    step scheduled after the load's step was processed (the next one; under async scheduling, where the load is
    asynchronous, one more)."""
    d = make_driver(prefix_caching=False, async_scheduling=async_scheduling, **INLINE)
    sharers(d)
    assert load_step(d, "second") == load_step(d, "first") + 1 + async_scheduling
    assert d.connector.scheduler_side.kvfsm.stats.deferrals >= 1


def test_control_a_sharer_kept_deferred_a_step_longer_is_caught(make_driver, monkeypatch) -> None:
    d = make_driver(prefix_caching=False, **INLINE)
    side = d.connector.scheduler_side
    original = side.get_num_new_matched_tokens
    held: set[str] = set()

    def defer_once_more(request, num_computed_tokens):
        if request.request_id in side.kvfsm.deferrals and request.request_id not in held:
            held.add(request.request_id)
            return None, False
        return original(request, num_computed_tokens)

    monkeypatch.setattr(side, "get_num_new_matched_tokens", defer_once_more)
    sharers(d)
    assert load_step(d, "second") > load_step(d, "first") + 1


# --- the lifecycle's new edges: every single-edit mutant is caught under vLLM -------------------------------------


def inline_mutants() -> dict[str, object]:
    """The spec mutants of the edges per-layer loads under vLLM added (and of the guard that tells them apart)."""
    return {m.name: m for m in spec_mutants() if "loading-inline" in m.name or "async-load" in m.name}


INLINE_MUTANTS = inline_mutants()
EQUIVALENT_UNDER_VLLM = {
    "request #23 (allocate matched -> loading-inline): drop guard has-external-tokens":
        "allocate matched -> running (no-external-tokens) comes first: an allocation without a load never gets here",
    "request #23 (allocate matched -> loading-inline): drop guard inline-load":
        "allocate matched -> loading (async-load) comes first and takes every asynchronous load",
    "request #25 (load-failed loading-inline -> running): drop effect mark-load-error":
        "vLLM hears of a failed load's blocks from its workers (get_block_ids_with_load_errors), never from kvfsm's "
        "scheduler half; kvfsm's own engine reads them there and catches it (tests/test_spec_mutants.py)",
    "request #27 (abort loading-inline -> draining): retarget to loading-inline":
        "vLLM aborts a request between steps, after it read the output that reported the request's inline load; "
        "kvfsm's own engine aborts one whose report is late and catches it (tests/test_spec_mutants.py)",
}
"""Mutants no run under vLLM can tell apart from the spec, each with the reason."""


def lifecycle_runs(make_driver) -> None:
    """Every way vLLM takes the new edges: an inline hit computed, finished before its report, preempted and aborted
    after it, a failed inline load under a running request; and a hit under async scheduling (no edge of them)."""
    reload(make_driver(**INLINE))
    reload(make_driver(**INLINE), max_tokens=1)
    preempted_after_inline_load(make_driver(gpu_blocks=HOG_BLOCKS + 5 + 1, **INLINE))
    aborted_after_its_inline_load(make_driver(**INLINE))
    failed_inline_load(make_driver(FakeWorker(fail_loads={"reader"}), **INLINE))
    reload(make_driver(async_scheduling=True, **INLINE))


def test_the_shipped_spec_passes_the_lifecycle_runs(make_driver) -> None:
    lifecycle_runs(make_driver)


def test_every_listed_equivalent_is_a_mutant_made_here() -> None:
    assert set(EQUIVALENT_UNDER_VLLM) <= set(INLINE_MUTANTS)


@pytest.mark.parametrize("name", sorted(INLINE_MUTANTS))
def test_inline_lifecycle_mutant_is_caught(name: str, make_driver, monkeypatch, tmp_path) -> None:
    try:
        spec = load_mutant(INLINE_MUTANTS[name], tmp_path)
    except SpecError:
        assert name not in EQUIVALENT_UNDER_VLLM
        return  # caught by the loader
    monkeypatch.setattr(scheduler_module, "default_spec", lambda: spec)
    if name in EQUIVALENT_UNDER_VLLM:
        lifecycle_runs(make_driver)
        return
    with pytest.raises(Exception):  # noqa: B017 (a refused trigger, a broken invariant or a crash: each is a catch)
        lifecycle_runs(make_driver)
