"""Malformed calls thrown at a running connector between legal engine steps: each is refused by its name, changes
nothing, and the run's integrity checks (invariants, trace, CPU bytes, outputs) still pass afterwards."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvfsm.connector.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    LoadOrder,
    ScheduledRequest,
    SchedulerOutput,
    WorkerOutput,
)
from kvfsm.connector.refusals import (
    AlreadyRegistered,
    BlockIdOutOfRange,
    ContradictoryStep,
    DuplicateBlockIds,
    MalformedRequest,
    MoreTokensThanOffered,
    NegativeTokenCount,
    RequestStateForbids,
    ReusedJobId,
    TokenCountBeyondRequest,
    UnalignedTokenCount,
    UnknownJob,
    UnknownRequest,
    UnknownWorker,
    WrongType,
)
from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import Harness
from kvfsm.testing.interleavings import PROMPTS
from kvfsm.testing.snapshot import snapshot

GPU_BLOCKS = 10


@dataclass
class Req:
    request_id: str
    block_hashes: tuple[int, ...]
    num_tokens: int


Call = Callable[[], object]
Malformed = Callable[[Harness, int], "Call | None"]
"""Given the harness and a drawn number, a malformed call that applies now, or None when none does."""


def _in_state(h: Harness, *states: str) -> list[str]:
    return sorted(r for r, record in h.connector.scheduler.requests.items() if record.state in states)


def _pick(ids: list[str], n: int) -> str | None:
    return ids[n % len(ids)] if ids else None


def _lookup_of_running(h: Harness, n: int) -> Call | None:
    rid = _pick([r for r in _in_state(h, "running") if r in h.engine.live], n)
    return None if rid is None else lambda: h.connector.get_num_new_matched_tokens(h.engine.live[rid], 0)


def _alloc_of_running(h: Harness, n: int) -> Call | None:
    rid = _pick([r for r in _in_state(h, "running") if r in h.engine.live], n)
    return None if rid is None else lambda: h.connector.update_state_after_alloc(h.engine.live[rid], [0], 0)


def _step(h: Harness, output: SchedulerOutput) -> Call:
    return lambda: h.connector.build_connector_meta(output)


def _running_step(h: Harness, n: int, make: Callable[[str], SchedulerOutput]) -> Call | None:
    rid = _pick(_in_state(h, "running"), n)
    return None if rid is None else _step(h, make(rid))


def _in_flight(h: Harness) -> list[int]:
    return sorted(j for j, job in h.connector.scheduler.jobs.items() if job.in_flight)


def _report(h: Harness, *workers: WorkerOutput) -> Call:
    return lambda: h.connector.update_connector_output(ConnectorOutput(workers=workers))


def _reused_job_id(h: Harness, n: int) -> Call | None:
    jobs = sorted(h.connector.worker.jobs)
    if not jobs:
        return None
    order = LoadOrder(job_id=jobs[n % len(jobs)], req_id="x", gpu_blocks=(0,), cpu_slots=(0,))
    return lambda: h.connector.worker.bind_connector_metadata(ConnectorMetadata(step=0, loads=(order,)))


FRESH = Req("malformed", (), 3)

MALFORMED: dict[str, tuple[type[Exception], Malformed]] = {
    "lookup-negative-tokens": (NegativeTokenCount,
                               lambda h, n: lambda: h.connector.get_num_new_matched_tokens(FRESH, -1 - n)),
    "lookup-beyond-request": (TokenCountBeyondRequest,
                              lambda h, n: lambda: h.connector.get_num_new_matched_tokens(FRESH, 4 + n)),
    "lookup-float-tokens": (WrongType, lambda h, n: lambda: h.connector.get_num_new_matched_tokens(FRESH, n + 0.5)),
    "lookup-empty-id": (MalformedRequest,
                        lambda h, n: lambda: h.connector.get_num_new_matched_tokens(Req("", (), 3), 0)),
    "lookup-of-a-running-request": (RequestStateForbids, _lookup_of_running),
    "alloc-unknown-request": (UnknownRequest,
                              lambda h, n: lambda: h.connector.update_state_after_alloc(FRESH, [0], 0)),
    "alloc-of-a-running-request": (RequestStateForbids, _alloc_of_running),
    "step-not-an-output": (WrongType, lambda h, n: lambda: h.connector.build_connector_meta(None)),  # type: ignore
    "step-unknown-preempted": (UnknownRequest, lambda h, n: _step(h, SchedulerOutput(preempted=("ghost",)))),
    "step-preempts-a-non-running-request": (RequestStateForbids, lambda h, n: (
        None if (r := _pick(_in_state(h, "loading", "deferred", "matched"), n)) is None
        else _step(h, SchedulerOutput(preempted=(r,))))),
    "step-preempts-and-schedules": (ContradictoryStep, lambda h, n: _running_step(h, n, lambda r: SchedulerOutput(
        scheduled=(ScheduledRequest(req_id=r, block_ids=(), num_computed_tokens=0),), preempted=(r,)))),
    "step-block-beyond-the-cache": (BlockIdOutOfRange, lambda h, n: _running_step(h, n, lambda r: SchedulerOutput(
        scheduled=(ScheduledRequest(req_id=r, block_ids=(*h.connector.scheduler.requests[r].block_ids, GPU_BLOCKS + n),
                                    num_computed_tokens=h.connector.scheduler.store_due[r]),)))),
    "step-negative-computed": (NegativeTokenCount, lambda h, n: _running_step(h, n, lambda r: SchedulerOutput(
        scheduled=(ScheduledRequest(req_id=r, block_ids=(), num_computed_tokens=-1 - n),)))),
    "report-unknown-job": (UnknownJob, lambda h, n: _report(h, WorkerOutput(done=(10_000 + n,)))),
    "report-unknown-worker": (UnknownWorker, lambda h, n: _report(h, WorkerOutput(worker=1 + n))),
    "report-a-job-twice": (UnknownJob, lambda h, n: (
        None if not (jobs := _in_flight(h))
        else _report(h, WorkerOutput(done=(jobs[n % len(jobs)],)), WorkerOutput(failed=(jobs[n % len(jobs)],))))),
    "finish-non-str-id": (MalformedRequest, lambda h, n: lambda: h.connector.request_finished(n)),  # type: ignore
    "finish-aborted-not-bool": (WrongType, lambda h, n: lambda: h.connector.request_finished("x", aborted=n)),  # type: ignore
    "finish-of-a-loading-request": (RequestStateForbids, lambda h, n: (
        None if (r := _pick(_in_state(h, "loading", "deferred"), n)) is None
        else lambda: h.connector.request_finished(r))),
    "register-again": (AlreadyRegistered, lambda h, n: lambda: h.connector.register_kv_caches(
        {f"layer.{i}": c for i, c in enumerate(h.engine.caches)}, "kv-first")),
    "bind-not-metadata": (WrongType, lambda h, n: lambda: h.connector.worker.bind_connector_metadata("meta")),  # type: ignore
    "bind-reused-job-id": (ReusedJobId, _reused_job_id),
}

STATEFUL = frozenset({
    "lookup-of-a-running-request", "alloc-of-a-running-request", "step-preempts-a-non-running-request",
    "step-preempts-and-schedules", "step-block-beyond-the-cache", "step-negative-computed", "report-a-job-twice",
    "finish-of-a-loading-request", "bind-reused-job-id",
})
"""The malformed calls that need a request or a job in some state; the others apply at any time."""

PROBE: dict[str, tuple[type[Exception], Callable[[Harness, Req, int, int], Call]]] = {
    "alloc-more-than-offered": (MoreTokensThanOffered, lambda h, r, offered, n: lambda: h.connector.
                                update_state_after_alloc(r, list(range(9)), offered + h.shape.block_size * (1 + n % 2))),
    "alloc-unaligned-tokens": (UnalignedTokenCount, lambda h, r, offered, n: lambda: h.connector.
                               update_state_after_alloc(r, list(range(9)), 1 + n % (h.shape.block_size - 1))),
    "alloc-block-beyond-the-cache": (BlockIdOutOfRange, lambda h, r, offered, n: lambda: h.connector.
                                     update_state_after_alloc(r, [0, GPU_BLOCKS + n], 0)),
    "alloc-block-twice": (DuplicateBlockIds, lambda h, r, offered, n: lambda: h.connector.
                          update_state_after_alloc(r, [n % GPU_BLOCKS] * 2, 0)),
}
"""Malformed allocations for a probe request that was looked up (legally) just before, then aborted (legally)."""

THROWN: Counter[str] = Counter()


class MalformedCalls(RuleBasedStateMachine):
    """The reference engine + kvfsm on a SimDevice; between steps, malformed calls at the connector."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(SimDevice(), num_gpu_blocks=GPU_BLOCKS, cpu_blocks=4)
        self.probes = 0
        self.turn = 0

    @rule(arrivals=st.lists(PROMPTS, max_size=2), forget=st.booleans(), lag=st.integers(0, 8))
    def step(self, arrivals: list[tuple[tuple[int, ...], int]], forget: bool, lag: int) -> None:
        """A legal engine step; the device then runs `lag` operations, so transfers stay in flight."""
        if forget:
            self.h.engine.reset_prefix_cache()
        for prompt, max_new in arrivals:
            if len(self.h.engine.live) < 4:
                self.h.add_request(prompt, max_new)
        self.h.engine.step()
        for _ in range(lag):
            options = self.h.device.runnable()
            if options:
                self.h.device.run_one(options[0])

    @rule(n=st.integers(0, 3))
    def malformed(self, n: int) -> None:
        """The next malformed call that applies in any state (in turn), and every one that needs a state the
        connector is in now (a running request, a load in flight, a job on the worker): each is thrown when it can
        be."""
        calls = {case: call for case, (_, make) in MALFORMED.items() if (call := make(self.h, n)) is not None}
        anytime = sorted(set(MALFORMED) - STATEFUL)
        self.turn += 1
        for case in (anytime[self.turn % len(anytime)], *sorted(STATEFUL & set(calls))):
            refused_unchanged(self.h, case, MALFORMED[case][0], calls[case])

    @rule(case=st.sampled_from(sorted(PROBE)), n=st.integers(0, 3), source=st.integers(0, 3))
    def probe(self, case: str, n: int, source: int) -> None:
        """Look a probe request up (it shares a live request's prefix, so it is often offered CPU blocks), throw a
        malformed allocation at it, then abort it: a lookup that was never allocated leaves nothing behind."""
        live = sorted(self.h.engine.live.values(), key=lambda r: r.request_id)
        hashes = live[source % len(live)].block_hashes if live else ()
        request = Req(f"probe-{self.probes}", hashes, (len(hashes) + 1) * self.h.shape.block_size)
        self.probes += 1
        match = self.h.connector.get_num_new_matched_tokens(request, 0)
        if match is not None:
            exception, make = PROBE[case]
            refused_unchanged(self.h, case, exception, make(self.h, request, match[0], n))
        self.h.connector.request_finished(request.request_id, aborted=True)

    @invariant()
    def spec_holds(self) -> None:
        assert not (found := self.h.violations()), "\n".join(found)

    def teardown(self) -> None:
        try:
            self.h.drain()
            found = self.h.final_violations()
            assert not found, "\n".join(found)
        finally:
            self.h.close()


def refused_unchanged(h: Harness, case: str, exception: type[Exception], call: Call) -> None:
    before = snapshot(h.connector)
    with pytest.raises(exception) as refused:
        call()
    assert type(refused.value) is exception, f"{case}: refused by {type(refused.value).__name__}, not {exception}"
    assert snapshot(h.connector) == before, f"{case}: the refused call changed the connector"
    THROWN[case] += 1


def test_malformed_calls_between_steps_are_refused_by_name_and_change_nothing() -> None:
    THROWN.clear()
    run_state_machine_as_test(MalformedCalls, settings=settings(max_examples=25, stateful_step_count=30))
    never = sorted((set(MALFORMED) | set(PROBE)) - set(THROWN))
    assert not never, f"malformed calls never thrown (no state they apply in was reached): {never}"


def test_control_a_malformed_call_that_gets_through_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the step check removed, a scheduled block beyond the cache is not refused: the rule fails."""
    def unchecked(sched, output):  # type: ignore[no-untyped-def]  # what check_step hands the planner, unchecked
        return [(sched.requests[s.req_id], s.block_ids, s.num_computed_tokens) for s in output.scheduled
                if s.num_computed_tokens >= sched.store_due[s.req_id]]

    monkeypatch.setattr("kvfsm.connector.scheduler.check_step", unchecked)
    machine = MalformedCalls()
    try:
        machine.h.add_request((11, 12, 13, 14, 15), 2)
        while not _in_state(machine.h, "running"):
            machine.h.engine.step()
        call = MALFORMED["step-block-beyond-the-cache"][1](machine.h, 0)
        assert call is not None
        with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
            refused_unchanged(machine.h, "step-block-beyond-the-cache", BlockIdOutOfRange, call)
    finally:
        machine.h.close()
