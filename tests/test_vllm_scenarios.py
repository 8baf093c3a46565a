"""The situations vLLM's own offloading-connector tests cover, rewritten for kvfsm under vLLM's real Scheduler.

Each test states one rule; the rule's control breaks the adapter where it keeps it and is caught. Every run is
also traced against the spec, checked with kvfsm's named invariants each step, and required drained at the end
(see `kvfsm.integrations.vllm.checks`). Skipped when vLLM is not installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, loads_of, make_driver, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm

OTHER = list(range(700, 700 + 4 * BLOCK_SIZE))
EXTENSION = list(range(2000, 2000 + 2 * BLOCK_SIZE))


def abort_while_storing(d: Driver) -> None:
    d.add("writer", PREFIX + [1, 2, 3], max_tokens=10)
    d.step()
    assert d.log[-1].orders.stores, "the prefill step ordered no store"
    d.scheduler.finish_requests("writer", RequestStatus.FINISHED_ABORTED)
    assert "writer" not in d.scheduler.requests, "vLLM kept the blocks of a request with only stores in flight"
    d.run()


def test_abort_while_storing_returns_the_blocks_at_once_and_the_store_lands(make_driver) -> None:
    d = make_driver(FakeWorker(store_steps=5))
    abort_while_storing(d)
    (store,) = d.log[0].orders.stores
    assert not any(store.job_id in log.orders.flush for log in d.log), "nobody was handed its blocks: no wait"
    assert d.connector.scheduler_side.kvfsm.stats.blocks_stored == 4
    assert d.cpu_pool_drained()


def test_request_finished_with_a_store_pending_returns_its_blocks_at_once(make_driver) -> None:
    worker = FakeWorker(store_steps=5)
    d = make_driver(worker)
    d.add("writer", PREFIX + [1, 2, 3], max_tokens=1)
    d.step()
    assert "writer" not in d.scheduler.requests, "vLLM kept the blocks of a request with only stores in flight"
    d.run()
    assert d.first_token["writer"] == 1
    assert d.step_no == 1 + worker.store_steps  # the worker's report of the store, nothing vLLM holds
    assert d.connector.scheduler_side.kvfsm.stats.blocks_stored == 4
    assert d.cpu_pool_drained()


def staggered_sharers(d: Driver) -> None:
    """reader0 loads PREFIX; reader1 (same prefix) and reader2 (PREFIX + EXTENSION) arrive while it loads;
    `other` needs an unrelated stored prefix."""
    store_prefix(d, PREFIX + EXTENSION + [1, 2, 3])
    store_prefix(d, OTHER + [1, 2, 3], req_id="other-writer")
    d.add("reader0", PREFIX + [7, 8])
    d.step()
    d.add("reader1", PREFIX + [9, 10])
    d.add("other", OTHER + [4, 5])
    d.step()
    d.add("reader2", PREFIX + EXTENSION + [11])
    d.run()


def test_staggered_sharers_of_a_loading_prefix_wait_for_that_load_only(make_driver) -> None:
    worker = FakeWorker(load_steps=4)
    d = make_driver(worker)
    staggered_sharers(d)
    landed = next(job.due for job in worker.loads if job.req_id == "reader0")
    assert not loads_of(d, "reader1")  # vLLM's GPU prefix cache serves it once reader0's load landed
    assert d.first_token["reader1"] == d.first_token["reader0"] == landed + 1
    (rest,) = loads_of(d, "reader2")
    assert len(rest.gpu_blocks) == 2  # only the part nobody else was loading
    assert next(log.step for log in d.log if rest in log.orders.loads) == landed + 1
    (other,) = loads_of(d, "other")
    assert next(log.step for log in d.log if other in log.orders.loads) == d.arrived["other"] + 1
    assert d.cpu_pool_drained()


def test_control_a_connector_that_defers_behind_any_load_convoys_the_unrelated_request(make_driver,
                                                                                       monkeypatch) -> None:
    d = make_driver(FakeWorker(load_steps=4))
    side = d.connector.scheduler_side
    original = side.get_num_new_matched_tokens

    def defer_while_anything_loads(request, num_computed_tokens):
        loading = any(job.kind == "load" and job.in_flight for job in side.kvfsm.jobs.values())
        return (None, False) if loading else original(request, num_computed_tokens)

    monkeypatch.setattr(side, "get_num_new_matched_tokens", defer_while_anything_loads)
    staggered_sharers(d)
    (other,) = loads_of(d, "other")
    assert next(log.step for log in d.log if other in log.orders.loads) > d.arrived["other"] + 1


def test_control_a_transition_made_behind_the_machines_is_caught_by_the_trace(make_driver) -> None:
    d = make_driver(FakeWorker(store_steps=3))
    d.add("writer", PREFIX + [1, 2, 3], max_tokens=4)
    d.step()
    (job,) = (j for j in d.connector.scheduler_side.kvfsm.jobs.values() if j.kind == "store")
    job.state = "done"  # not through the transfer-job machine
    with pytest.raises(SpecViolation, match="trace: .*is 'done', but its last transition left it"):
        d.step()
