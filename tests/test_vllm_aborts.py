"""Requests aborted at awkward moments: one vLLM looked up but found no room for, aborted while it waits, whose lookup
the scheduler side forgets with it; one a prefix-cache reset preempted, aborted before the next step, which that step
reports both finished and preempted. Skipped without vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker  # noqa: E402
from vllm_support import PREFIX, loads_of, make_driver, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm


def test_a_request_aborted_while_waiting_for_room_leaves_no_lookup_behind(make_driver) -> None:
    """The GPU is nearly all a long request's, so the reader, offered its CPU hit, waits for room each step; aborted
    then, it leaves no lookup kept for an allocation that will never come."""
    d = make_driver(gpu_blocks=16)
    store_prefix(d)
    d.add("hog", list(range(3000, 3000 + 12 * BLOCK_SIZE)), max_tokens=8)
    d.step()
    d.add("reader", PREFIX + [9])
    d.step()
    side = d.connector.scheduler_side
    assert "reader" in side._matched and not loads_of(d, "reader"), "the reader was not left waiting for room"
    d.scheduler.finish_requests("reader", RequestStatus.FINISHED_ABORTED)
    d.run()
    assert side._matched == {}
    assert d.cpu_pool_drained()



@pytest.mark.parametrize("store_steps", [1, 6], ids=["stores-ended", "stores-in-flight"])
def test_a_request_preempted_by_a_cache_reset_and_aborted_before_the_next_step_ends_cleanly(make_driver,
                                                                                           store_steps: int) -> None:
    """vLLM's `reset_prefix_cache(reset_running_requests=True)` preempts every running request; one aborted before
    the next step is in that step's finished and preempted requests both."""
    d = make_driver(FakeWorker(store_steps=store_steps))
    d.add("reader", list(range(500, 500 + 4 * BLOCK_SIZE + 1)), max_tokens=8)
    d.step()
    d.step()
    d.scheduler.reset_prefix_cache(reset_running_requests=True)
    d.scheduler.finish_requests("reader", RequestStatus.FINISHED_ABORTED)
    d.run()
    assert d.cpu_pool_drained()
