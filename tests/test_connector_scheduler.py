"""The connector's scheduler half, driven directly: one behaviour per test, each safety rule also run on a control.

A step here is what an engine would do: look up, allocate, build the metadata, then feed back what the workers
reported. The workers are played by the test, so every report (late, duplicate, failed, from one of two ranks)
is exactly the one the rule is about.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pytest

from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    ScheduledRequest,
    SchedulerOutput,
    StoreOrder,
    WorkerOutput,
)
from kvfsm.connector.refusals import UnknownJob, UnknownWorker
from kvfsm.connector.scheduler import RequestView, SchedulerConnector, StepResult
from kvfsm.machines import IllegalTrigger
from kvfsm.manager import BlockStored, PolicyViolation
from kvfsm.testing.mutants import complete_on_first_report, publish_on_partial_failure

BLOCK = 4
"""Tokens per GPU block in these tests."""
GPU_BLOCK_BYTES = 64


@dataclass
class Req:
    """The three things the connector reads of an engine request."""

    request_id: str
    block_hashes: tuple[int, ...]
    num_tokens: int


def prompt(request_id: str, hashes: Sequence[int], extra_tokens: int = 1) -> Req:
    """A request whose prompt fills `len(hashes)` GPU blocks plus `extra_tokens` more."""
    return Req(request_id, tuple(hashes), len(hashes) * BLOCK + extra_tokens)


def connector(cpu_blocks: int = 8, k: int = 1, workers: int = 1) -> SchedulerConnector:
    config = OffloadConfig(cpu_blocks=cpu_blocks, block_size_factor=k, gpu_block_size=BLOCK, num_workers=workers,
                           kv_events=True)
    return SchedulerConnector(config, GPU_BLOCK_BYTES, keep_history=True)


def report(sched: SchedulerConnector, done: Sequence[int] = (), failed: Sequence[int] = (),
           worker: int = 0) -> StepResult:
    return sched.update_connector_output(
        ConnectorOutput(workers=(WorkerOutput(worker=worker, done=tuple(done), failed=tuple(failed)),)))


def admit(sched: SchedulerConnector, req: RequestView, blocks: Sequence[int], gpu_hit_blocks: int = 0,
          accept: bool = True) -> tuple[int, bool] | None:
    """Look `req` up after a GPU prefix hit of `gpu_hit_blocks` and, unless deferred, allocate `blocks` for it."""
    match = sched.get_num_new_matched_tokens(req, gpu_hit_blocks * BLOCK)
    if match is not None:
        sched.update_state_after_alloc(req, blocks, match[0] if accept else 0)
    return match


def compute(sched: SchedulerConnector, req: Req, blocks: Sequence[int],
            computed: int | None = None) -> ConnectorMetadata:
    """One step in which `req` computes up to `computed` tokens (default: all of them)."""
    scheduled = ScheduledRequest(req_id=req.request_id, block_ids=tuple(blocks),
                                 num_computed_tokens=req.num_tokens if computed is None else computed)
    return sched.build_connector_meta(SchedulerOutput(scheduled=(scheduled,)))


def idle_step(sched: SchedulerConnector, preempted: Sequence[str] = ()) -> ConnectorMetadata:
    return sched.build_connector_meta(SchedulerOutput(preempted=tuple(preempted)))


def store_prefix(sched: SchedulerConnector, req: Req, blocks: Sequence[int]) -> tuple[int, ...]:
    """Run `req` as a miss, store its full blocks and finish it: its prefix ends up ready on CPU."""
    assert admit(sched, req, blocks) == (0, False)
    meta = compute(sched, req, blocks)
    idle_step(sched)  # the workers submit last step's stores as this step starts
    job_ids = tuple(order.job_id for order in meta.stores)
    report(sched, done=job_ids)
    assert sched.request_finished(req.request_id) is False
    return job_ids


def in_flight(sched: SchedulerConnector) -> list[int]:
    return [job.job_id for job in sched.jobs.values() if job.in_flight]


# lookup ----------------------------------------------------------------------------------------------------


def test_lookup_counts_only_whole_cpu_blocks() -> None:
    sched = connector(k=2)
    store_prefix(sched, prompt("a", [1, 2, 3, 4]), range(5))
    # Three GPU blocks of the stored prefix, then a different fourth: the second CPU block (hash 4) misses as a
    # whole, so only the first CPU block's two GPU blocks hit.
    assert sched.get_num_new_matched_tokens(prompt("b", [1, 2, 3, 9]), 0) == (2 * BLOCK, True)


def test_lookup_offers_a_load_from_the_middle_of_a_cpu_block() -> None:
    sched = connector(k=2)
    store_prefix(sched, prompt("a", [1, 2, 3, 4]), range(5))
    req = prompt("b", [1, 2, 3, 4])
    assert admit(sched, req, range(10, 15), gpu_hit_blocks=3) == (BLOCK, True)
    (load,) = idle_step(sched).loads
    assert (load.gpu_blocks, load.gpu_offset) == ((13,), 1)
    assert load.cpu_slots == (sched.manager.catalogue[4],)


def check_leaves_last_token(sched: SchedulerConnector) -> None:
    store_prefix(sched, prompt("a", [1, 2, 3, 4], extra_tokens=0), range(4))
    match = sched.get_num_new_matched_tokens(prompt("b", [1, 2, 3, 4], extra_tokens=0), 0)
    assert match == (3 * BLOCK, True), "a full-prompt hit must leave the last block to compute"


class LoadsWholePrompt(SchedulerConnector):
    """Control: offers every cached block, the last prompt token included."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool] | None:
        return super().get_num_new_matched_tokens(
            Req(request.request_id, tuple(request.block_hashes), request.num_tokens + BLOCK), num_computed_tokens)


def test_the_last_prompt_token_is_never_loaded() -> None:
    check_leaves_last_token(connector())
    config = OffloadConfig(cpu_blocks=8, gpu_block_size=BLOCK)
    with pytest.raises(AssertionError):
        check_leaves_last_token(LoadsWholePrompt(config, GPU_BLOCK_BYTES))


# one load per prefix ---------------------------------------------------------------------------------------


def test_concurrent_lookups_of_one_prefix_make_one_load_and_defer_the_rest() -> None:
    sched = connector()
    store_prefix(sched, prompt("a", [1, 2, 3, 4]), range(5))
    first, second, third = (prompt(name, [1, 2, 3, 4]) for name in "bcd")
    assert admit(sched, first, range(5, 10)) == (4 * BLOCK, True)
    assert admit(sched, second, range(10, 15)) is None
    assert admit(sched, third, range(15, 20)) is None
    (load,) = idle_step(sched).loads
    assert (sched.stats.deferrals, set(sched.deferrals)) == (2, {"c", "d"})
    assert {d.blockers for d in sched.deferrals.values()} == {frozenset({load.job_id})}
    assert report(sched, done=[load.job_id]).loaded == {"b"}
    # The next lookups see the engine's GPU prefix cache holding what "b" loaded: nothing left to load.
    assert admit(sched, second, range(10, 15), gpu_hit_blocks=4) == (0, False)
    assert admit(sched, third, range(15, 20), gpu_hit_blocks=4) == (0, False)
    assert sched.deferrals == {} and sched.stats.deferrals == 2


def test_a_deferred_request_loads_only_what_nobody_else_loaded() -> None:
    sched = connector()
    store_prefix(sched, prompt("a", [1, 2, 3, 4]), range(5))
    assert admit(sched, prompt("b", [1, 2]), range(5, 8)) == (2 * BLOCK, True)
    assert admit(sched, prompt("c", [1, 2, 3, 4]), range(8, 13)) is None
    (load,) = idle_step(sched).loads
    report(sched, done=[load.job_id])
    assert admit(sched, prompt("c", [1, 2, 3, 4]), range(8, 13), gpu_hit_blocks=2) == (2 * BLOCK, True)
    (second,) = idle_step(sched).loads
    assert second.gpu_blocks == (10, 11)
    assert second.cpu_slots == tuple(sched.manager.catalogue[h] for h in (3, 4))


def test_a_lookup_defers_while_its_prefix_is_being_stored() -> None:
    sched = connector()
    req = prompt("a", [1, 2])
    admit(sched, req, range(3))
    meta = compute(sched, req, range(3))
    assert admit(sched, prompt("b", [1, 2]), range(3, 6)) is None
    assert sched.deferrals["b"].blockers == {meta.stores[0].job_id}


def test_a_deferred_lookup_waits_only_for_the_job_holding_its_first_busy_block() -> None:
    sched = connector()
    req = prompt("a", [1, 2])
    admit(sched, req, range(3))
    (first,) = compute(sched, req, range(3), computed=BLOCK).stores
    (second,) = compute(sched, req, range(3), computed=2 * BLOCK).stores
    assert first.job_id != second.job_id
    assert admit(sched, prompt("b", [1, 2]), range(3, 6)) is None
    assert sched.deferrals["b"].blockers == {first.job_id}


def test_a_request_aborted_while_deferred_behind_its_own_store_returns_until_that_store_ends() -> None:
    """Preempted while its store still copies, looked up again (deferred: its own prefix is being stored), then
    aborted: its blocks are the engine's already, and the request is released, without news, once the store ends."""
    sched = connector()
    req = prompt("a", [1, 2])
    admit(sched, req, range(3))
    (order,) = compute(sched, req, range(3)).stores
    idle_step(sched, preempted=["a"])  # the store is flushed: the workers copy it before the blocks are reused
    assert sched.get_num_new_matched_tokens(req, 0) is None
    assert sched.requests["a"].state == "deferred"
    assert sched.request_finished("a", aborted=True) is False
    assert sched.requests["a"].state == "returned"
    assert report(sched, done=[order.job_id]).released == set()
    assert sched.requests["a"].state == "released"


# stores ----------------------------------------------------------------------------------------------------


def check_stores_only_computed_blocks(sched: SchedulerConnector) -> None:
    req = prompt("a", [1, 2, 3, 4])
    admit(sched, req, range(5))
    first = compute(sched, req, range(5), computed=2 * BLOCK + 3)
    assert [o.gpu_blocks for o in first.stores] == [(0, 1)], "a block whose compute is not complete was stored"
    second = compute(sched, req, range(5))
    assert [o.gpu_blocks for o in second.stores] == [(2, 3)]


class StoresPartialBlocks(SchedulerConnector):
    """Control: rounds the computed tokens up to a whole block, storing a half-computed one."""

    def _order_store(self, req_id: str, block_ids: Sequence[int], num_computed_tokens: int) -> StoreOrder | None:
        return super()._order_store(req_id, block_ids, -(-num_computed_tokens // BLOCK) * BLOCK)


def test_only_fully_computed_blocks_are_stored() -> None:
    check_stores_only_computed_blocks(connector())
    with pytest.raises(AssertionError):
        check_stores_only_computed_blocks(StoresPartialBlocks(OffloadConfig(cpu_blocks=8, gpu_block_size=BLOCK),
                                                              GPU_BLOCK_BYTES))


def test_blocks_already_on_cpu_are_not_stored_again() -> None:
    sched = connector()
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    req = prompt("b", [1, 2, 3, 4])
    admit(sched, req, range(3, 8), accept=False)  # the engine recomputes instead of loading
    (order,) = compute(sched, req, range(3, 8)).stores
    assert order.gpu_blocks == (5, 6)
    assert sched.stats.blocks_stored == 2


def test_a_pool_full_of_pinned_blocks_refuses_a_store_without_harm() -> None:
    sched = connector(cpu_blocks=2)
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    admit(sched, prompt("b", [1, 2]), range(3, 6))  # pins both slots for a load
    before = [(b.state, b.block_hash, b.readers) for b in sched.manager.blocks]
    other = prompt("c", [7, 8])
    admit(sched, other, range(6, 9))
    assert compute(sched, other, range(6, 9)).stores == ()
    assert sched.stats.store_refusals == 1
    assert [(b.state, b.block_hash, b.readers) for b in sched.manager.blocks] == before
    assert sched.manager.take_events() == [BlockStored((1, 2))]


@pytest.mark.parametrize(("guard", "refusal"), [(True, PolicyViolation), (False, IllegalTrigger)])
def test_evicting_a_pinned_block_is_refused_by_the_manager_and_behind_it_by_the_spec(guard: bool,
                                                                                    refusal: type) -> None:
    """Control for the test above: a policy that ignores pins answers a loading block; the manager refuses the
    answer, and with that check removed the spec still refuses the eviction."""
    sched = connector(cpu_blocks=2)
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    admit(sched, prompt("b", [1, 2]), range(3, 6))
    sched.manager.policy.victims = lambda n, evictable: [0, 1][:n]  # type: ignore[method-assign]
    if not guard:
        sched.manager._check_victims = lambda *_: None  # type: ignore[method-assign]
    other = prompt("c", [7, 8])
    admit(sched, other, range(6, 9))
    with pytest.raises(refusal):
        compute(sched, other, range(6, 9))


# completions and failures ----------------------------------------------------------------------------------


def check_failed_store_frees_its_slots(sched: SchedulerConnector) -> None:
    req = prompt("a", [1, 2])
    admit(sched, req, range(3))
    (order,) = compute(sched, req, range(3)).stores
    idle_step(sched)
    report(sched, failed=[order.job_id])
    assert sched.stats.stores_failed == 1
    assert [sched.manager.blocks[s].state for s in order.cpu_slots] == ["free", "free"], "a failed store kept slots"
    assert sched.manager.catalogue == {} and sched.manager.take_events() == []
    assert order.job_id in sched.reported_failed
    assert sched.get_num_new_matched_tokens(prompt("b", [1, 2]), 0) == (0, False), "a failed block became ready"


def test_a_failed_store_frees_its_cpu_slots_and_is_never_ready() -> None:
    check_failed_store_frees_its_slots(connector())
    control = connector()
    complete = control.manager.complete_store
    control.manager.complete_store = lambda slots, ok: complete(slots, True)  # type: ignore[method-assign]
    with pytest.raises(AssertionError):
        check_failed_store_frees_its_slots(control)


def test_a_failed_load_is_reported_as_load_errors() -> None:
    sched = connector()
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    admit(sched, prompt("b", [1, 2]), range(3, 6))
    (load,) = idle_step(sched).loads
    result = report(sched, failed=[load.job_id])
    assert result.loaded == {"b"} and result.load_errors == {"b": (3, 4)}
    assert sched.get_block_ids_with_load_errors() == {3, 4}
    assert sched.get_block_ids_with_load_errors() == set(), "load errors are reported once"
    assert sched.stats.loads_failed == 1
    assert [b.state for b in sched.manager.blocks[:2]] == ["ready", "ready"], "a failed load unpins its blocks"


def two_worker_store(sched: SchedulerConnector) -> int:
    req = prompt("a", [1, 2])
    admit(sched, req, range(3))
    (order,) = compute(sched, req, range(3)).stores
    idle_step(sched)
    return order.job_id


def check_waits_for_every_worker(sched: SchedulerConnector) -> None:
    job_id = two_worker_store(sched)
    report(sched, done=[job_id], worker=0)
    assert sched.jobs[job_id].state == "submitted", "a job completed before every worker reported it"
    report(sched, done=[job_id], worker=1)
    assert sched.jobs[job_id].state == "done"


def test_with_two_workers_a_job_completes_when_both_reported() -> None:
    check_waits_for_every_worker(connector(workers=2))
    control = connector(workers=2)
    complete_on_first_report(control)
    with pytest.raises(AssertionError):
        check_waits_for_every_worker(control)


def test_with_two_workers_a_job_fails_if_either_failed() -> None:
    sched = connector(workers=2)
    job_id = two_worker_store(sched)
    report(sched, done=[job_id], worker=0)
    report(sched, failed=[job_id], worker=1)
    assert sched.jobs[job_id].state == "failed" and sched.manager.catalogue == {}


@pytest.mark.parametrize(("case", "error"), [("duplicate", UnknownJob), ("never ordered", UnknownJob),
                                             ("finished", UnknownJob), ("no such rank", UnknownWorker)])
def test_a_report_the_scheduler_cannot_place_is_a_named_error(case: str, error: type[Exception]) -> None:
    sched = connector(workers=2)
    job_id = two_worker_store(sched)
    report(sched, done=[job_id], worker=0)
    bad = {"duplicate": (job_id, 0), "never ordered": (job_id + 100, 1), "finished": (job_id, 1),
           "no such rank": (job_id, 2)}[case]
    if case == "finished":
        report(sched, done=[job_id], worker=1)
    with pytest.raises(error):
        report(sched, done=[bad[0]], worker=bad[1])


def test_an_output_with_a_bad_report_applies_none_of_its_reports() -> None:
    sched = connector(workers=2)
    job_id = two_worker_store(sched)
    report(sched, done=[job_id], worker=0)
    output = ConnectorOutput(workers=(WorkerOutput(worker=1, done=(job_id,)), WorkerOutput(worker=0, done=(job_id,))))
    with pytest.raises(UnknownJob):
        sched.update_connector_output(output)
    assert sched.jobs[job_id].state == "submitted" and sched.jobs[job_id].reports == {0: True}, \
        "rank 1's good report was applied although the output was refused"


@pytest.mark.parametrize("control", [False, True])
def test_a_job_any_rank_failed_publishes_none_of_its_slots(control: bool) -> None:
    sched = connector(workers=2)
    if control:
        publish_on_partial_failure(sched)
    job_id = two_worker_store(sched)
    report(sched, failed=[job_id], worker=0)
    assert sched.jobs[job_id].state == "submitted", "a job failed before every rank reported it"
    report(sched, done=[job_id], worker=1)
    published = sched.jobs[job_id].state != "failed" or sched.manager.catalogue != {}
    assert published == control, "a job one rank failed published its slots" if published else "control missed"
