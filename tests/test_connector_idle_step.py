"""An idle step (no request scheduled, preempted or reported, nothing ordered the step before) does no work: the
scheduler half hands out the step's number in an otherwise empty metadata, fires no transition, ends nothing
(`NOTHING_ENDED`, one shared result) and moves no counter. A step with nothing scheduled that still has orders to
hand out (stores the step before ordered, a load allocated, a flush) is not idle; the control that takes it for one
(`IDLE_CONTROLS`) leaves its stores unsubmitted, and is caught."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from kvfsm.connector.ledger import NOTHING_ENDED
from kvfsm.connector.metadata import ConnectorMetadata, ConnectorOutput
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.states import TransferJobState
from kvfsm.testing.mutants import IDLE_CONTROLS

from test_connector_scheduler import admit, compute, connector, idle_step, prompt, report, store_prefix


def test_an_idle_step_orders_nothing_fires_nothing_ends_nothing_and_moves_no_counter() -> None:
    sched = connector()
    store_prefix(sched, prompt("a", [1, 2, 3]), range(4))
    fired: list[tuple[Any, ...]] = []
    sched.machines.observe(lambda *transition: fired.append(transition))
    totals, step = sched.stats.as_dict(), sched.step
    for _ in range(3):
        assert idle_step(sched) == ConnectorMetadata(step=step + 1)
        assert sched.update_connector_output(ConnectorOutput()) is NOTHING_ENDED
        step += 1
    assert fired == [] and sched.stats.as_dict() == totals and sched.get_block_ids_with_load_errors() == set()


def check_stores_submitted_after_nothing_scheduled(control: Callable[[SchedulerConnector], None] | None = None
                                                    ) -> None:
    """A request's stores are ordered, then it finishes and the next step schedules nothing: that step's metadata
    submits them (the workers submit them as the step starts), and their report ends them."""
    sched = connector()
    if control is not None:
        control(sched)
    req = prompt("a", [1, 2, 3])
    admit(sched, req, range(4))
    (store,) = compute(sched, req, range(4)).stores
    sched.request_finished("a")
    idle_step(sched)
    assert sched.jobs[store.job_id].state == TransferJobState.SUBMITTED
    report(sched, done=[store.job_id])
    assert sched.jobs[store.job_id].state == TransferJobState.DONE


def test_a_step_with_nothing_scheduled_still_submits_the_stores_ordered_the_step_before() -> None:
    check_stores_submitted_after_nothing_scheduled()


@pytest.mark.parametrize("control", IDLE_CONTROLS)
def test_a_step_taken_for_idle_with_stores_to_submit_is_caught(control: str) -> None:
    with pytest.raises(AssertionError):
        check_stores_submitted_after_nothing_scheduled(IDLE_CONTROLS[control])


def test_a_step_with_nothing_scheduled_still_hands_out_the_stores_a_cache_reset_flushed() -> None:
    """Only a flush to hand out (a submitted store the reset flushed; nothing prepared, allocated or loading): the
    step is not idle, and its metadata names the store for the workers to wait for."""
    sched = connector()
    req = prompt("a", [1, 2, 3])
    admit(sched, req, range(4))
    (store,) = compute(sched, req, range(4)).stores
    idle_step(sched)  # the workers submit it as this step starts
    sched.request_finished("a")
    sched.reset_cache()
    assert idle_step(sched).flush == (store.job_id,)
