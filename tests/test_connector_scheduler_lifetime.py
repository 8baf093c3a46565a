"""The scheduler half over a request's life and at its edges: finishing, aborting and preempting requests, what the
half hands the engine (metadata, events, counters, fences) and how it is built. The steps are played as in
`test_connector_scheduler.py`, whose helpers these tests share.
"""

from __future__ import annotations

from kvfsm.checking.world import ConnectorWorld
from kvfsm.config import OffloadConfig
from kvfsm.connector.fences import GpuFences
from kvfsm.connector.metadata import ConnectorMetadata, ConnectorOutput, ScheduledRequest, SchedulerOutput, WorkerOutput
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.invariants import inline_load_in_step
from kvfsm.machines import default_machines
from kvfsm.manager import BlockRemoved, BlockStored
from test_connector_scheduler import (
    BLOCK,
    GPU_BLOCK_BYTES,
    Req,
    admit,
    compute,
    connector,
    idle_step,
    in_flight,
    prompt,
    report,
    store_prefix,
)


# request lifetime ------------------------------------------------------------------------------------------


def test_a_finished_request_with_stores_in_flight_returns_its_blocks_freed_while_read() -> None:
    sched = connector()
    req = prompt("a", [1, 2])
    admit(sched, req, range(3))
    (order,) = compute(sched, req, range(3)).stores
    assert sched.request_finished("a") is False
    assert sched.requests["a"].state == "returned"
    assert {b for b, g in sched.gpu_blocks.items() if g.state == "freed-while-read"} == {0, 1}
    assert idle_step(sched).flush == (), "nobody was handed the blocks: nothing to wait for"
    assert report(sched, done=[order.job_id]).released == set(), "the engine freed the blocks already"
    assert sched.gpu_blocks == {} and sched.requests["a"].state == "released"


def test_the_step_that_hands_out_a_freed_block_flushes_the_stores_reading_it() -> None:
    sched = connector()
    req = prompt("a", [1, 2, 3, 4])
    admit(sched, req, range(5))
    (submitted,) = compute(sched, req, range(5), computed=2 * BLOCK).stores
    (pending,) = compute(sched, req, range(5)).stores
    assert sched.request_finished("a") is False
    other = prompt("b", [7])
    admit(sched, other, (3, 9))  # block 3, which the pending store reads, is handed out again
    assert compute(sched, other, (3, 9)).flush == (pending.job_id,)
    assert sched.gpu_blocks[3].state == "fenced" and sched.gpu_blocks[0].state == "freed-while-read"
    assert sched.jobs[submitted.job_id].state == "submitted", "a store reading no block handed out goes on"
    assert report(sched, done=[pending.job_id]).released == set() and sched.requests["a"].state == "returned"
    report(sched, done=[submitted.job_id])
    assert sched.requests["a"].state == "released" and 0 not in sched.gpu_blocks


def test_a_freed_block_in_a_running_requests_table_is_fenced_at_its_next_step() -> None:
    """A block shared through the engine's prefix cache stays in another request's table: that request's step may
    write (or read) it, so the step fences it like an allocation."""
    sched = connector()
    req = prompt("a", [1, 2])
    admit(sched, req, range(3))
    (order,) = compute(sched, req, range(3)).stores
    sharer = prompt("b", [1, 5])
    admit(sched, sharer, (0, 4, 5), gpu_hit_blocks=1)  # block 0 is a GPU prefix hit, shared with a
    assert compute(sched, sharer, (0, 4, 5), computed=BLOCK + 1).flush == ()
    sched.request_finished("a")
    assert sched.gpu_blocks[0].state == "freed-while-read"
    assert compute(sched, sharer, (0, 4, 5)).flush == (order.job_id,)


def test_a_finished_request_without_stores_is_released_at_once() -> None:
    sched = connector()
    req = Req("a", (), 3)
    admit(sched, req, range(1))
    compute(sched, req, range(1))
    assert sched.request_finished("a") is False
    assert sched.request_finished("never-seen") is False


def test_abort_while_loading_releases_when_the_load_lands() -> None:
    sched = connector()
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    admit(sched, prompt("b", [1, 2]), range(3, 6))
    (load,) = idle_step(sched).loads
    assert sched.request_finished("b", aborted=True) is True
    result = report(sched, done=[load.job_id])
    assert result.released == {"b"} and result.loaded == set()
    assert [b.readers for b in sched.manager.blocks] == [0] * 8


def test_abort_while_storing_returns_the_blocks_and_lets_the_store_run() -> None:
    sched = connector()
    req = prompt("a", [1, 2])
    admit(sched, req, range(3))
    (order,) = compute(sched, req, range(3)).stores
    assert sched.request_finished("a", aborted=True) is False
    assert sched.requests["a"].state == "returned"
    assert idle_step(sched).flush == ()
    assert sched.jobs[order.job_id].state == "submitted"
    assert report(sched, done=[order.job_id]).released == set()
    assert sched.manager.lookup([1, 2]).hits == 2, "an aborted request's store still publishes its finished copy"


def test_a_request_id_can_be_reused_after_it_finished() -> None:
    sched = connector()
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    again = prompt("a", [1, 2])
    assert admit(sched, again, range(3, 6)) == (2 * BLOCK, True)
    (load,) = idle_step(sched).loads
    assert report(sched, done=[load.job_id]).loaded == {"a"}
    compute(sched, again, range(3, 6))
    assert sched.request_finished("a") is False


def test_preemption_flushes_pending_and_submitted_stores_in_the_next_metadata() -> None:
    sched = connector()
    req = prompt("a", [1, 2, 3, 4])
    admit(sched, req, range(5))
    (submitted,) = compute(sched, req, range(5), computed=2 * BLOCK).stores
    (pending,) = compute(sched, req, range(5)).stores
    assert sched.jobs[submitted.job_id].state == "submitted"
    meta = idle_step(sched, preempted=["a"])
    assert set(meta.flush) == {submitted.job_id, pending.job_id}
    assert {sched.jobs[j].state for j in meta.flush} == {"flushed-on-preempt"}
    report(sched, done=meta.flush)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True), "the resumed request reloads from CPU"


def test_reset_cache_with_transfers_in_flight_publishes_nothing_and_leaks_nothing() -> None:
    sched = connector(cpu_blocks=4)
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    admit(sched, prompt("b", [1, 2]), range(3, 6))
    writer = prompt("c", [5, 6])
    admit(sched, writer, range(6, 9))
    (store,) = compute(sched, writer, range(6, 9)).stores
    (load,) = [o for o in sched.jobs.values() if o.kind == "load"]
    sched.request_finished("c")
    sched.manager.take_events()
    sched.reset_cache()
    meta = idle_step(sched)
    assert meta.flush == (store.job_id,)
    assert sched.manager.take_events() == [BlockRemoved((1, 2))]
    result = report(sched, done=[load.job_id, store.job_id])
    assert result.loaded == {"b"} and result.released == set()
    assert sched.manager.catalogue == {} and sched.manager.take_events() == []
    assert sched.manager.usage()["free"] == 4
    assert in_flight(sched) == [] and sched.gpu_blocks == {}


# what leaves the scheduler ---------------------------------------------------------------------------------


def test_metadata_round_trips_through_json() -> None:
    sched = connector()
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    admit(sched, prompt("b", [1, 2]), range(3, 6))
    writer = prompt("c", [5, 6])
    admit(sched, writer, range(6, 9))
    orders = compute(sched, writer, range(6, 9))
    flush = idle_step(sched, preempted=["c"])
    assert orders.loads and orders.stores and flush.flush
    for meta in (orders, flush):
        assert ConnectorMetadata.model_validate_json(meta.model_dump_json()) == meta
    output = ConnectorOutput(workers=(WorkerOutput(worker=1, done=(3,), failed=(4,)),))
    assert ConnectorOutput.model_validate_json(output.model_dump_json()) == output


def test_events_announce_stores_and_evictions() -> None:
    sched = connector(cpu_blocks=2)
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    assert sched.manager.take_events() == [BlockStored((1, 2))]
    store_prefix(sched, prompt("b", [7]), range(3, 5))
    assert sched.manager.take_events() == [BlockRemoved((2,)), BlockStored((7,))]


def test_stats_count_lookups_hits_transfers_and_bytes() -> None:
    sched = connector(k=2)
    store_prefix(sched, prompt("a", [1, 2, 3, 4]), range(5))
    admit(sched, prompt("b", [1, 2, 3, 4]), range(5, 10))
    (load,) = idle_step(sched).loads
    report(sched, done=[load.job_id])
    assert admit(sched, prompt("c", [9, 9]), range(10, 13)) == (0, False)
    stats = sched.stats.as_dict()
    assert stats.pop("store_seconds") > 0 and stats.pop("load_seconds") > 0
    assert stats == dict(
        lookups=3, cpu_hit_blocks=4, cpu_misses=2, deferrals=0, store_refusals=0, blocks_skipped_prompt_only=0,
        blocks_skipped_threshold=0, blocks_stored=2,
        blocks_loaded=4, bytes_stored=2 * 2 * GPU_BLOCK_BYTES, bytes_loaded=4 * GPU_BLOCK_BYTES,
        stores_failed=0, loads_failed=0, loads_async=1, loads_inline=0)


def test_a_fence_record_made_on_first_use_names_its_block() -> None:
    """Without the pool size, a GPU block's fence record is made the first time a store reads it; fence-count and
    the engine find it by its id."""
    fences = GpuFences(default_machines()["gpu-block"])
    fences.fire("fence", [5, 2])
    fences.fire("fence", [7])  # beyond every block named before: the records grow again, each at its id
    assert {b: block.block_id for b, block in fences.fenced().items()} == {5: 5, 2: 2, 7: 7}


def test_a_step_scheduling_a_request_not_yet_allocated_plans_nothing_for_it() -> None:
    sched = connector()
    looked_up = prompt("looked-up", [1, 2])
    assert sched.get_num_new_matched_tokens(looked_up, 0) == (0, False)
    assert compute(sched, looked_up, range(3)).stores == ()
    assert sched.ledger.requests["looked-up"].state == "matched"


def test_a_store_is_ordered_in_the_step_that_completes_its_cpu_block() -> None:
    sched = connector()
    request = Req("r", (501, 502), 9)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, (0, 1, 2), 0)
    first = sched.build_connector_meta(SchedulerOutput(scheduled=(ScheduledRequest("r", (0, 1, 2), 4),))).stores
    assert [s.gpu_blocks for s in first] == [(0,)]
    second = sched.build_connector_meta(SchedulerOutput(scheduled=(ScheduledRequest("r", (0, 1, 2), 8),))).stores
    assert [s.gpu_blocks for s in second] == [(1,)], "the second block completed this step and was not stored"


def test_a_request_finished_without_saying_aborted_lets_its_stores_run_unflushed() -> None:
    sched = connector()
    request = Req("r", (501,), 5)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, (0, 1), 0)
    (store,) = sched.build_connector_meta(SchedulerOutput(scheduled=(ScheduledRequest("r", (0, 1), 4),))).stores
    sched.request_finished("r")
    assert sched.ledger.requests["r"].state == "returned"
    assert store.job_id not in sched.build_connector_meta(SchedulerOutput()).flush, "a finish flushed eagerly"


def test_a_store_covers_only_the_gpu_blocks_its_step_names() -> None:
    sched = connector()
    req = prompt("a", [1, 2, 3, 4])
    admit(sched, req, range(5))
    (order,) = compute(sched, req, (0, 1)).stores  # all tokens computed, two blocks named
    assert (order.gpu_blocks, len(order.cpu_slots)) == ((0, 1), 2)


def test_every_store_the_pool_has_no_room_for_adds_to_the_refusals() -> None:
    sched = connector(cpu_blocks=1)
    admit(sched, prompt("a", [1]), range(2))
    assert len(compute(sched, prompt("a", [1]), range(2)).stores) == 1  # its slot stays busy: never reported
    for name, hashes, blocks in (("b", [2], (2, 3)), ("c", [3], (4, 5))):
        admit(sched, prompt(name, hashes), blocks)
    both = SchedulerOutput(scheduled=(ScheduledRequest(req_id="b", block_ids=(2, 3), num_computed_tokens=BLOCK + 1),
                                      ScheduledRequest(req_id="c", block_ids=(4, 5), num_computed_tokens=BLOCK + 1)))
    assert sched.build_connector_meta(both).stores == ()
    assert sched.stats.store_refusals == 2


# construction ------------------------------------------------------------------------------------------------


def test_a_scheduler_half_keeps_no_history_and_records_no_kv_events_unless_asked() -> None:
    sched = SchedulerConnector(OffloadConfig(cpu_blocks=8, gpu_block_size=BLOCK), GPU_BLOCK_BYTES)
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    assert sched.manager.take_events() == [] and "a" not in sched.ledger.requests and not sched.jobs


def test_a_pool_sized_in_bytes_holds_the_whole_cpu_blocks_that_fit() -> None:
    config = OffloadConfig(cpu_bytes=10 * 2 * GPU_BLOCK_BYTES + 1, block_size_factor=2, gpu_block_size=BLOCK)
    assert len(SchedulerConnector(config, GPU_BLOCK_BYTES).manager.blocks) == 10


def test_the_first_step_is_numbered_one() -> None:
    assert idle_step(connector()).step == 1


def test_a_fresh_scheduler_half_reports_no_load_errors() -> None:
    assert connector().get_block_ids_with_load_errors() == set()


def test_load_errors_the_engine_did_not_read_are_gone_after_the_next_output() -> None:
    """`get_block_ids_with_load_errors` names the blocks of the last output's failed loads: an output replaces what
    the engine did not read of the one before."""
    sched = connector()
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    admit(sched, prompt("b", [1, 2]), range(3, 6))
    (load,) = idle_step(sched).loads
    report(sched, failed=[load.job_id])
    report(sched)
    assert sched.get_block_ids_with_load_errors() == set()


def inline_load_reported(late: bool) -> list[str]:
    """An engine that reads a failed load's blocks only in the output of its step (vLLM) loads `b`'s CPU hit
    inline; each step's output follows its metadata, and the load is reported in its own step's output, or (`late`)
    in the next one. What `inline-load-in-step` finds then."""
    config = OffloadConfig(cpu_blocks=8, gpu_block_size=BLOCK, layer_loads=True)
    sched = SchedulerConnector(config, GPU_BLOCK_BYTES, keep_history=True)  # the reported load stays visible
    sched.load_reports_in_step = True
    writer = prompt("a", [1, 2])
    admit(sched, writer, range(3))
    (store,) = compute(sched, writer, range(3)).stores
    report(sched)
    idle_step(sched)
    report(sched, done=[store.job_id])
    sched.request_finished("a")
    reader = prompt("b", [1, 2])
    admit(sched, reader, range(3, 6))
    (load,) = compute(sched, reader, range(3, 6)).loads
    if late:
        report(sched)
        idle_step(sched)
    report(sched, done=[load.job_id])
    return inline_load_in_step(ConnectorWorld(sched))


def test_an_inline_load_reported_in_the_output_of_its_own_step_is_in_step() -> None:
    assert inline_load_reported(late=False) == []


def test_control_an_inline_load_reported_an_output_late_is_caught() -> None:
    (found,) = inline_load_reported(late=True)
    assert "computed on in step 3 but reported in output 4" in found

