"""Connector behaviours that need a whole engine (loads from the middle of a CPU block, one load per prefix,
preemption): the reference engine + kvfsm on a `SimDevice`, via the Harness.

The Harness checks every named invariant, the bytes of every ready CPU block and, once drained, that each
request's tokens equal the run without offloading; each test adds the numbers its rule is about. A control is
the same scenario with one rule removed, and the test asserts the checks catch it. The shared scenario helpers are
in `engine_scenarios.py`.
"""

from __future__ import annotations

import pytest

from kvfsm.connector.metadata import LoadOrder
from kvfsm.invariants import Deferral
from kvfsm.machines import IllegalTrigger
from kvfsm.states import TransferJobState
from kvfsm.testing.harness import Harness

from engine_scenarios import PREFIX, finish, harness, mutant, offload, step_lagging


# loads from the middle of a CPU block ----------------------------------------------------------------------


def run_partial_cpu_block_load(h: Harness) -> list[str]:
    """GPU holds 3 blocks of a 2-block-CPU prefix: the load starts in the middle of the second CPU block."""
    prompt = PREFIX[:10]
    offload(h, prompt)
    h.add_request(prompt[:6] + (90, 91, 92), 2)  # loads CPU block 0, computes GPU block 2 (cached on GPU)
    h.drain()
    loads: list[LoadOrder] = []
    worker = h.connector.worker
    submit = worker._submit_load
    worker._submit_load = lambda order: (loads.append(order), submit(order))[-1]  # type: ignore[method-assign]
    h.add_request(prompt + (50,), 2)
    violations = finish(h)
    assert [(o.gpu_offset, len(o.gpu_blocks)) for o in loads] == [(1, 1)], "the load did not start mid CPU block"
    assert h.engine.gpu_hit_tokens == 6
    return violations


def test_a_load_from_the_middle_of_a_cpu_block_round_trips_exactly() -> None:
    assert run_partial_cpu_block_load(harness(k=2)) == []


def test_a_load_that_ignores_the_offset_is_caught() -> None:
    def from_offset_zero(h: Harness) -> None:
        worker = h.connector.worker
        submit = worker._submit_load
        worker._submit_load = lambda order: submit(order.model_copy(update={"gpu_offset": 0}))  # type: ignore
    found = run_partial_cpu_block_load(harness(k=2, control=from_offset_zero))
    assert any(line.startswith("output:") for line in found)


# one load per prefix, no convoy ----------------------------------------------------------------------------


def first_token_steps(h: Harness, names: tuple[str, ...], steps: int = 12) -> dict[str, int]:
    """Step the engine (device settled after each step) and note the step of each request's first token."""
    first: dict[str, int] = {}
    for number in range(1, steps + 1):
        h.engine.step()
        h.settle()
        assert not (found := h.violations()), "\n".join(found)
        for request in [*h.engine.live.values(), *h.engine.finished]:
            if request.request_id in names and request.num_sampled and request.request_id not in first:
                first[request.request_id] = number
    return first


def run_shared_prefix(h: Harness) -> dict[str, int]:
    offload(h)
    h.add_request(PREFIX[:9], 1, "short")  # 4 GPU blocks: CPU blocks 0-1
    h.add_request(PREFIX[:17], 1, "long")  # 8 GPU blocks: CPU blocks 0-3
    return first_token_steps(h, ("short", "long"))


def test_concurrent_lookups_make_one_load_and_the_deferred_request_loads_only_the_rest() -> None:
    h = harness(k=2)
    first = run_shared_prefix(h)
    scheduler = h.connector.scheduler
    loads = sorted((j for j in scheduler.jobs.values() if j.kind == "load"), key=lambda j: j.job_id)
    assert [(j.req_id, len(j.cpu_slots)) for j in loads] == [("short", 2), ("long", 2)]
    assert scheduler.stats.deferrals == 2  # at the lookup of step 1 and at step 2, before the load was reported
    assert h.engine.gpu_hit_tokens == 8 and h.engine.cpu_hit_tokens == 8 + 8
    # short: load (1), reported (2), compute (3); long: deferred (1, 2), load (3), reported (4), compute (5).
    assert first == {"short": 3, "long": 5}
    assert finish(h) == []


def test_a_request_aborted_while_deferred_leaves_no_deferral_behind() -> None:
    """A deferral lives as long as its request: a connector that kept it would grow with every aborted request."""
    h = harness(k=2)
    offload(h)
    h.add_request(PREFIX[:9], 1, "short")
    h.add_request(PREFIX[:17], 1, "long")
    h.engine.step()
    assert "long" in h.connector.scheduler.ledger.deferrals
    h.abort("long")
    assert finish(h) == []
    assert h.connector.scheduler.ledger.deferrals == {}


def test_a_second_load_of_a_loading_block_is_caught() -> None:
    with pytest.raises((AssertionError, IllegalTrigger)):
        run_shared_prefix(harness(k=2, control=mutant("no-load-dedup")))


def test_a_request_deferred_after_its_blocker_finished_is_caught() -> None:
    def one_step_late(h: Harness) -> None:
        """Control: a request deferred by its previous lookup is deferred once more on the same blockers, although
        they finished (a convoy: it waits for a re-poll instead of proceeding)."""
        scheduler = h.connector.scheduler
        lookup, late = scheduler.get_num_new_matched_tokens, set()

        def convoy(request, num_computed_tokens):  # type: ignore[no-untyped-def]
            earlier = scheduler.deferrals.get(request.request_id)
            match = lookup(request, num_computed_tokens)
            if match is None or earlier is None or request.request_id in late:
                return match
            late.add(request.request_id)
            scheduler.ledger.fire_request(scheduler.requests[request.request_id], "lookup", busy=True)
            scheduler.deferrals[request.request_id] = Deferral(scheduler.step + 1, earlier.blockers)
            return None
        scheduler.get_num_new_matched_tokens = convoy  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="no-convoy"):
        run_shared_prefix(harness(k=2, control=one_step_late))


def test_a_request_looked_up_while_its_blocker_is_in_flight_is_answered_from_its_standing_deferral() -> None:
    """standing-deferral: the second lookup of the deferred request finds the load it waits on still in flight and
    answers "not yet" with no lookup and no transition, its deferral kept; the third, after the load ended, is real."""
    h = harness(k=2)
    scheduler, ledger = h.connector.scheduler, h.connector.scheduler.ledger
    lookups, standing, fire, stands = [], [], ledger.fire_request, ledger.stands

    def fired(record, trigger, **context):  # type: ignore[no-untyped-def]
        if (record.req_id, trigger) == ("long", "lookup"):
            lookups.append((scheduler.step, scheduler.deferrals.get("long")))
        return fire(record, trigger, **context)

    def answered(record, step):  # type: ignore[no-untyped-def]
        stood = stands(record, step)
        if stood:
            standing.append((record.req_id, step, record.standing, scheduler.deferrals[record.req_id]))
        return stood

    ledger.fire_request, ledger.stands = fired, answered  # type: ignore[method-assign]
    assert run_shared_prefix(h) == {"short": 3, "long": 5}
    (first, none), (third, kept) = lookups
    assert none is None and third == first + 2 and kept is not None and kept.step == first + 1
    assert standing == [("long", first + 1, first + 1, kept)]  # the deferral the first lookup made, unchanged
    assert scheduler.stats.deferrals == 2 and finish(h) == []


def test_a_deferral_never_looked_at_again_is_caught() -> None:
    with pytest.raises(AssertionError, match="standing-deferral"):
        run_shared_prefix(harness(k=2, control=mutant("deferral-never-re-examined")))


# preemption ------------------------------------------------------------------------------------------------


def run_preempt_and_resume(h: Harness) -> list[str]:
    """Preempt a request the step after its prefill (its stores still in flight), its blocks reclaimed as memory
    pressure would, and hand them to another request the next step, with the host running ahead of the device;
    compute goes first whenever it can (SimDevice's default)."""
    h.add_request(PREFIX[:12], 4, "a")
    step_lagging(h)
    h.engine.preempt("a", reclaim=True)
    step_lagging(h)
    h.add_request(tuple(range(60, 72)), 2, "b")
    step_lagging(h)
    return finish(h)


def test_a_preempted_request_reloads_what_it_stored() -> None:
    h = harness()
    assert run_preempt_and_resume(h) == []
    assert h.engine.preemptions == 1
    assert h.engine.cpu_hit_tokens == 12, "the resumed request recomputed instead of reloading"
    assert h.connector.scheduler.stats.blocks_loaded == 6


def test_a_worker_that_does_not_flush_on_preemption_corrupts_data() -> None:
    found = run_preempt_and_resume(harness(control=mutant("no-preemption-flush")))
    assert any(line.startswith("fence:") for line in found)
    assert any(line.startswith("ready-means-written:") for line in found)
    assert any(line.startswith("output:") for line in found)


def run_preempt_mid_copy(h: Harness) -> list[str]:
    """Preempt a request whose store was submitted a step earlier and is still on the (lagging) copy stream, its
    blocks reclaimed and handed to another request the next step; compute goes first whenever it can."""
    h.add_request(PREFIX[:12], 4, "a")
    step_lagging(h)
    step_lagging(h)
    stores = [j for j in h.connector.worker.jobs.values() if j.kind == "store"]
    assert [j.state for j in stores] == [TransferJobState.SUBMITTED], "the scenario needs a store on the copy stream"
    h.engine.preempt("a", reclaim=True)
    step_lagging(h)
    h.add_request(tuple(range(60, 72)), 2, "b")
    step_lagging(h)
    return finish(h)


def test_preemption_waits_for_a_store_already_on_the_copy_stream() -> None:
    h = harness()
    assert run_preempt_mid_copy(h) == []
    assert h.engine.preemptions == 1


def test_a_preemption_that_skips_stores_already_copying_is_caught() -> None:
    found = run_preempt_mid_copy(harness(control=mutant("flush-waits-pending-only")))
    assert any(line.startswith("fence:") for line in found)
    assert any(line.startswith("ready-means-written:") for line in found)
