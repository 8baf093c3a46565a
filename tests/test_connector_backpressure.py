"""Back-pressure on stores (spec: transfer-job's `stores-bounded`, request's `skip-store` with reason `shed`;
tier-job's `writeback-queue-bounded` and its `shed` edge): when stores fall behind, new ones are shed by a bound
instead of queueing without one, and a shed block is simply not stored.

One rule per test, driven through the scheduler half as an engine would; then the reference engine with every
check, where a shed block costs a recompute and no wrong token, and each rule's control is caught.
"""

from __future__ import annotations

from typing import Any, Sequence

import pydantic
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvfsm.bindings import default_spec
from kvfsm.config import QUEUE_BOUND_WITHOUT_QUEUE, OffloadConfig
from kvfsm.connector.backpressure import CPU_TIER, SHED
from kvfsm.connector.prometheus import KvfsmCollector
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.executor.sim import SimDevice
from kvfsm.states import TierJobState
from kvfsm.testing.harness import Harness
from test_connector_scheduler import BLOCK, GPU_BLOCK_BYTES, Req, admit, compute, idle_step, prompt, report


def connector(bound: int | None) -> SchedulerConnector:
    config = OffloadConfig(cpu_blocks=16, gpu_block_size=BLOCK, store_max_blocks_in_flight=bound)
    return SchedulerConnector(config, GPU_BLOCK_BYTES, keep_history=True)


def stored(sched: SchedulerConnector) -> list[int]:
    return [h for job in sched.jobs.values() if job.kind == "store" for h in job.hashes]


# configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, True, "2", 1.5])
def test_a_store_bound_that_is_not_a_positive_int_is_refused(value: Any) -> None:
    with pytest.raises(pydantic.ValidationError, match="store_max_blocks_in_flight"):
        OffloadConfig(cpu_blocks=4, store_max_blocks_in_flight=value)


@pytest.mark.parametrize("value", [0, -3, True])
def test_a_queue_bound_that_is_not_a_positive_int_is_refused(value: Any) -> None:
    tier = {"kind": "disk", "path": "/tmp/kvfsm-unused", "capacity_bytes": 64, "writeback": "eager",
            "writeback_max_queued_blocks": value}
    with pytest.raises(pydantic.ValidationError, match="writeback_max_queued_blocks"):
        OffloadConfig(cpu_blocks=4, lower_tiers=[tier])


def test_a_queue_bound_on_an_on_evict_tier_is_refused_by_name() -> None:
    """An on-evict tier has no queue: the bound would bound nothing, so it is a mistake, named."""
    tier = {"kind": "disk", "path": "/tmp/kvfsm-unused", "capacity_bytes": 64, "writeback": "on-evict",
            "writeback_max_queued_blocks": 4}
    with pytest.raises(pydantic.ValidationError) as refused:
        OffloadConfig(cpu_blocks=4, lower_tiers=[tier])
    assert [e["type"] for e in refused.value.errors()] == [QUEUE_BOUND_WITHOUT_QUEUE]


# the scheduler half ----------------------------------------------------------------------------------------


def test_no_bound_stores_every_block_a_request_completes() -> None:
    sched = connector(None)
    req = prompt("a", [1, 2, 3])
    admit(sched, req, range(4))
    compute(sched, req, range(4))
    assert stored(sched) == [1, 2, 3] and not sched.stats.store_shed


def test_blocks_beyond_the_bound_are_shed_the_last_first() -> None:
    sched = connector(2)
    req = prompt("a", [1, 2, 3])
    admit(sched, req, range(4))
    (order,) = compute(sched, req, range(4)).stores
    assert stored(sched) == [1, 2] and order.gpu_blocks == (0, 1)
    assert sched.requests["a"].skipped == {3: SHED}
    assert sched.stats.store_shed == {CPU_TIER: 1}


def test_a_shed_block_is_a_skip_store_transition_of_its_running_request() -> None:
    sched = connector(1)
    seen: list[tuple[str, str, str]] = []
    sched.machines["request"].observers.append(
        lambda lifecycle, model, source, trigger, dest: seen.append((source, trigger, dest)))
    req = prompt("a", [1, 2, 3])
    admit(sched, req, range(4))
    compute(sched, req, range(4))
    assert seen.count(("running", "skip-store", "running")) == 1


def test_stores_in_flight_of_every_request_share_the_bound() -> None:
    sched = connector(3)
    a, b = prompt("a", [1, 2]), prompt("b", [11, 12])
    admit(sched, a, range(3))
    admit(sched, b, range(3, 6))
    compute(sched, a, range(3))
    compute(sched, b, range(3, 6))
    assert stored(sched) == [1, 2, 11] and sched.stats.store_shed[CPU_TIER] == 1
    assert sched.ledger.store_blocks_in_flight == 3


def run_to_report(sched: SchedulerConnector, req: Req, blocks: Sequence[int], ok: bool = True) -> None:
    """`req` computes its prompt; its store goes out next step and is reported done (or failed)."""
    admit(sched, req, blocks, accept=False)
    (order,) = compute(sched, req, blocks).stores
    idle_step(sched)
    report(sched, **{"done" if ok else "failed": [order.job_id]})


def test_room_returns_as_stores_end() -> None:
    sched = connector(1)
    req = prompt("a", [1])
    run_to_report(sched, req, range(3))
    assert sched.ledger.store_blocks_in_flight == 0
    req.block_hashes += (2,)
    req.num_tokens += BLOCK
    compute(sched, req, range(3))
    assert stored(sched) == [1, 2] and not sched.stats.store_shed


def test_a_failed_store_gives_its_room_back_too() -> None:
    sched = connector(1)
    run_to_report(sched, prompt("a", [1]), range(3), ok=False)
    assert sched.ledger.store_blocks_in_flight == 0


def test_a_block_the_pool_holds_is_never_shed() -> None:
    """Held blocks cost no store: they neither take room nor count as shed, so the new blocks after them fit."""
    sched = connector(2)
    run_to_report(sched, prompt("a", [1, 2]), range(3))
    sched.request_finished("a")
    second = prompt("b", [1, 2, 3, 4])
    admit(sched, second, range(3, 8), accept=False)  # recomputes the held prefix: its blocks are offered again
    compute(sched, second, range(3, 8))
    assert stored(sched) == [1, 2, 3, 4] and not sched.stats.store_shed


def test_a_shed_block_stays_shed_for_its_request() -> None:
    """A shed is final for the request, as every skip is: its later stores never carry the block, even with room."""
    sched = connector(1)
    req = prompt("a", [1, 2])
    run_to_report(sched, req, range(4))
    req.block_hashes += (3,)
    req.num_tokens += BLOCK
    compute(sched, req, range(4))
    assert 2 not in stored(sched) and sched.requests["a"].skipped == {2: SHED}


def test_shed_blocks_are_counted_in_prometheus_by_tier() -> None:
    sched = connector(1)
    req = prompt("a", [1, 2, 3])
    admit(sched, req, range(4))
    compute(sched, req, range(4))
    registry = CollectorRegistry()
    registry.register(KvfsmCollector.of(sched))
    assert 'kvfsm_store_shed_total{tier="cpu"} 2.0' in generate_latest(registry).decode()


# the reference engine --------------------------------------------------------------------------------------


PROMPTS = [tuple(range(10 * i, 10 * i + 9)) for i in (1, 2, 3)]
"""Three prompts of four full blocks each (block size 2), computed in the same steps: their stores pile up."""


def run(mutant: str | None = None, **options: Any) -> tuple[list[str], int, Harness]:
    """The reference engine over `PROMPTS`, every step checked; the violations, the peak of the store blocks in
    flight, and the (closed) harness."""
    h = Harness(SimDevice(), num_gpu_blocks=32, cpu_blocks=16, mutant=mutant, **options)
    try:
        for tokens in PROMPTS:
            h.add_request(tokens, 2)
        found, peak = [], 0
        while h.engine.has_work or h.connector.scheduler.moving_between_tiers:
            h.engine.step()
            h.settle()
            found += h.violations()
            peak = max(peak, h.connector.scheduler.ledger.store_blocks_in_flight)
        return found + h.final_violations(), peak, h
    finally:
        h.close()


def test_unbounded_stores_pile_up_on_the_reference_engine() -> None:
    """What the bound is for: without it every block completed in a step is in flight at once."""
    found, peak, _ = run()
    assert found == [] and peak > 2


def test_the_bound_holds_and_shedding_costs_no_wrong_token_on_the_reference_engine() -> None:
    """Every check passes (outputs equal to a run without offloading, every ready CPU block's bytes, drain) with
    stores shed."""
    found, peak, h = run(store_bound=2)
    stats = h.connector.scheduler.stats
    assert found == [] and peak <= 2
    assert stats.store_shed[CPU_TIER] > 0 and stats.blocks_stored > 0


def test_control_a_bound_per_store_is_caught_by_stores_bounded() -> None:
    found, _, _ = run("bound-per-store", store_bound=2)
    assert any(line.startswith("stores-bounded") for line in found), found


def offered_again(report_lag: int, reset: bool) -> tuple[list[str], Harness]:
    """A two-block prompt under a bound of one (its first block stored, its second shed), preempted in its first
    step and recomputed, its blocks offered again: with a cache reset between, while the first block's store from
    before is still in flight (`report_lag` 1); without, once it ended. The violations at every step, and the
    (closed) harness."""
    h = Harness(SimDevice(), num_gpu_blocks=6, cpu_blocks=2, report_lag=report_lag, store_bound=1)
    try:
        h.add_request((11, 12, 13, 14), 2)
        h.engine.step()
        found = h.violations()
        h.engine.preempt(h.engine.running[0].request_id)
        for stream in ("compute", "store"):  # the step's forward, then the store's copy, land
            while stream in h.device.runnable():
                h.device.run_one(stream)
        h.engine.step()
        if reset:
            h.connector.reset_cache()
        while h.engine.has_work:
            h.engine.step()
            found += h.violations()
            h.settle()
        return found + h.final_violations(), h
    finally:
        h.close()


def test_a_block_admitted_before_a_preemption_is_not_shed_when_offered_again() -> None:
    """Its store from the first offer may still be in flight: shed now, the request's skip would contradict it
    (`skipped-not-stored`); it is left unstored for want of room instead."""
    found, h = offered_again(report_lag=1, reset=True)
    assert found == [] and list(h.connector.scheduler.stats.store_shed.values()) == [1]


def test_a_shed_block_stays_shed_when_its_preempted_request_offers_it_again_with_room() -> None:
    found, h = offered_again(report_lag=0, reset=False)
    assert found == [] and list(h.connector.scheduler.stats.store_shed.values()) == [1]


def test_a_saturated_tier_sheds_its_write_backs_by_the_spec() -> None:
    """A disk tier whose queue holds one block: the write-backs beyond it are shed as tier jobs created -> shed,
    every check holds (eager-every-tier counts them offered), and the shed blocks are counted under the tier."""
    found, _, h = run(disk_slots=16, writeback_queue_blocks=1)
    sched = h.connector.scheduler
    shed = [job for job in sched.tier_jobs.values() if job.state == TierJobState.SHED]
    assert found == []
    assert shed and all(job.kind == "write-back" and job.cpu_slots == () for job in shed)
    assert sched.stats.store_shed["disk"] == sum(len(job.keys) for job in shed)


def test_control_a_queue_bound_per_batch_is_caught_by_writeback_queue_bounded() -> None:
    found, _, _ = run("queue-bound-per-batch", disk_slots=16, writeback_queue_blocks=1)
    assert any(line.startswith("writeback-queue-bounded") for line in found), found


def test_a_shed_write_back_leaves_only_created_and_ends_there() -> None:
    """The tier-job `shed` edge: a shed write-back is never submitted, and nothing follows its shed."""
    lifecycle = default_spec()["tier-job"]
    edges = [(t.source, t.dest) for t in lifecycle.transitions if t.trigger == "shed"]
    assert edges == [((TierJobState.CREATED,), TierJobState.SHED)]
    assert TierJobState.SHED in lifecycle.terminal
