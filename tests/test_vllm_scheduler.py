"""kvfsm's vLLM adapter under vLLM's real Scheduler on the CPU, against a fake worker that completes jobs late.

Each scenario states one rule; each safety rule has a control that breaks the adapter where it keeps the rule, and
the control is caught. Every run is traced against the spec and checked with kvfsm's named invariants after each
step; a run that ends with anything not drained fails (`SpecViolation`). Skipped when vLLM is not installed (the
main suite runs without it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvfsm.integrations.vllm import InvalidExtraConfig  # noqa: E402
from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.integrations.vllm.rig import FakeWorker, vllm_config  # noqa: E402
from kvfsm.integrations.vllm.scheduler_side import UnexpectedAllocation  # noqa: E402
from vllm_harness import Driver, HeldBlockReleased  # noqa: E402
from vllm_support import BLOCK_SIZE, PREFIX, hide_preemptions, loads_of, make_driver, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm


def test_prefix_stored_by_one_request_reloads_for_the_next(make_driver) -> None:
    d = make_driver()
    store_prefix(d)
    d.add("reader", PREFIX + [1, 2, 3])
    d.run()
    (load,) = loads_of(d, "reader")
    assert len(load.gpu_blocks) == 4
    first_scheduled = next(log for log in d.log if "reader" in log.first_computed)
    assert first_scheduled.first_computed["reader"] == len(PREFIX)
    assert d.cpu_pool_drained()


def test_a_prefix_stored_under_one_tenants_salt_is_a_miss_for_another_tenant(make_driver) -> None:
    """vLLM's per-request `cache_salt` enters the block hashes kvfsm keys its CPU blocks (and lower-tier keys) by."""
    d = make_driver()
    d.add("writer", PREFIX + [1, 2, 3], cache_salt="tenant-a")
    d.run()
    d.reset_gpu_prefix_cache()
    d.add("other-tenant", PREFIX + [1, 2, 3], cache_salt="tenant-b")
    d.add("no-tenant", PREFIX + [1, 2, 3])
    d.add("same-tenant", PREFIX + [1, 2, 3], cache_salt="tenant-a")
    d.run()
    assert loads_of(d, "other-tenant") == [] and loads_of(d, "no-tenant") == []
    assert loads_of(d, "same-tenant")
    assert d.cpu_pool_drained()


def shared_prefix_run(d: Driver, readers: int) -> dict[str, int]:
    store_prefix(d)
    for i in range(readers):
        d.add(f"reader{i}", PREFIX + [500 + i, 600 + i])
    start = d.step_no
    d.run()
    return {req: step - start for req, step in d.first_token.items() if req.startswith("reader")}


def test_shared_prefix_loads_once_and_every_reader_starts_the_step_after_the_load(make_driver) -> None:
    worker = FakeWorker(load_steps=3)
    d = make_driver(worker)
    steps = shared_prefix_run(d, readers=4)
    (load,) = worker.loads
    assert d.connector.scheduler_side.kvfsm.stats.deferrals == 3 * 3  # three readers, three steps of loading
    assert {d.first_token[req] for req in steps} == {load.due + 1}
    assert set(steps.values()) == {4}, steps  # load ordered in the readers' first step, lands in their third
    assert d.cpu_pool_drained()


def test_a_request_that_reads_no_prefix_cache_is_never_deferred(make_driver) -> None:
    """vLLM's `Scheduler.schedule` asks about a request that reads no prefix cache (`skip_reading_prefix_cache`, here
    for its prompt logprobs), then sets the answer aside, "not yet" included, and schedules it at once with no external
    tokens. Arriving while another request loads the prefix it shares, it is offered nothing and not deferred, so kvfsm
    tracks it as vLLM runs it: deferred, it would still be deferred when it finishes, and its finish refused."""
    d = make_driver(FakeWorker(load_steps=3))
    store_prefix(d)
    d.add("loader", PREFIX + [9])
    d.step()
    stats = d.connector.scheduler_side.kvfsm.stats
    deferrals = stats.deferrals
    d.add("logprobs", PREFIX + [9], prompt_logprobs=1)
    d.run()
    assert stats.deferrals == deferrals
    assert loads_of(d, "logprobs") == []
    assert d.steps_to_first_token("logprobs") == 1
    assert d.cpu_pool_drained()


def readers_hash_conversions(d: Driver, monkeypatch) -> int:
    """Block hashes converted in a run of a writer, then four readers deferred behind one load (three lookups each
    before their own)."""
    codec = d.connector.scheduler_side.codec
    converted = []
    to_int = codec.to_int
    monkeypatch.setattr(codec, "to_int", lambda h: converted.append(h) or to_int(h))
    shared_prefix_run(d, readers=4)
    assert d.connector.scheduler_side.kvfsm.stats.deferrals == 3 * 3
    return len(converted)


def test_a_deferred_request_converts_each_block_hash_once_over_its_lookups(make_driver, monkeypatch) -> None:
    d = make_driver(FakeWorker(load_steps=3))
    assert readers_hash_conversions(d, monkeypatch) == 5 * len(PREFIX) // BLOCK_SIZE  # each request's blocks once
    assert d.connector.scheduler_side._views == {}  # each kept until its request finished


def test_control_a_view_made_anew_per_lookup_converts_a_deferred_prompt_again(make_driver, monkeypatch) -> None:
    d = make_driver(FakeWorker(load_steps=3))
    side = d.connector.scheduler_side
    keep = side._views_of
    monkeypatch.setattr(side, "_views_of", lambda request: (side._views.clear(), keep(request))[1])
    assert readers_hash_conversions(d, monkeypatch) > 5 * len(PREFIX) // BLOCK_SIZE


def test_control_without_finished_recving_the_loader_never_starts(make_driver, monkeypatch) -> None:
    d = make_driver(FakeWorker(load_steps=3))
    side = d.connector.scheduler_side
    original = side.update_connector_output

    def forget_loaded(output) -> None:
        before = set(output.finished_recving or ())
        original(output)
        output.finished_recving = before or None

    monkeypatch.setattr(side, "update_connector_output", forget_loaded)
    with pytest.raises(AssertionError, match="not idle"):
        shared_prefix_run(d, readers=4)


def preemption_run(d: Driver) -> None:
    d.add("a", PREFIX, max_tokens=60)
    d.add("b", [900 + t for t in range(len(PREFIX))], max_tokens=60)
    d.run(max_steps=200)


def test_preempted_request_flushes_its_stores_and_reloads_from_cpu(make_driver) -> None:
    d = make_driver(FakeWorker(store_steps=4, load_steps=2), gpu_blocks=11)
    preemption_run(d)
    preempted = [log for log in d.log if log.orders.flush]
    assert preempted, "no store was in flight when vLLM preempted"
    victim = next(r for log in d.log for r in log.first_computed if log.step > preempted[0].step)
    assert loads_of(d, victim), f"{victim} resumed without reloading from CPU"
    assert d.first_token.keys() == {"a", "b"}
    assert d.cpu_pool_drained()


def test_control_preemption_not_passed_on_releases_blocks_a_store_reads(make_driver, monkeypatch) -> None:
    hide_preemptions(monkeypatch)
    d = make_driver(FakeWorker(store_steps=4, load_steps=2), gpu_blocks=11)
    with pytest.raises(HeldBlockReleased):
        preemption_run(d)


def abort_during_load(d: Driver) -> None:
    store_prefix(d)
    d.add("reader", PREFIX + [1])
    d.step()
    assert loads_of(d, "reader")
    d.scheduler.finish_requests("reader", RequestStatus.FINISHED_ABORTED)
    d.run()


def test_abort_during_load_holds_blocks_until_the_load_lands_then_drains(make_driver) -> None:
    d = make_driver(FakeWorker(load_steps=4))
    abort_during_load(d)
    assert "reader" not in d.first_token
    assert "reader" not in d.scheduler.requests
    assert d.cpu_pool_drained()


def test_control_abort_not_passed_on_leaves_the_pool_undrained(make_driver, monkeypatch) -> None:
    d = make_driver(FakeWorker(load_steps=4))
    side = d.connector.scheduler_side
    original = side.request_finished
    monkeypatch.setattr(side, "request_finished",
                        lambda request: (False, None) if request.request_id == "reader" else original(request))
    with pytest.raises(SpecViolation, match="drained: request reader is running"):
        abort_during_load(d)
    assert not d.cpu_pool_drained()


def failed_load(d: Driver) -> int:
    """Computed tokens the reader starts from after its load failed."""
    store_prefix(d)
    d.add("reader", PREFIX + [1, 2])
    d.run()
    return next(log.first_computed["reader"] for log in d.log if "reader" in log.first_computed)


def test_failed_load_is_recomputed_not_used(make_driver) -> None:
    d = make_driver(FakeWorker(fail_loads={"reader"}))
    assert failed_load(d) == 0
    assert d.first_token.keys() == {"writer", "reader"}
    assert d.connector.scheduler_side.kvfsm.stats.loads_failed == 1
    assert d.cpu_pool_drained()


def test_control_failed_load_without_its_blocks_is_computed_on_garbage(make_driver) -> None:
    d = make_driver(FakeWorker(fail_loads={"reader"}, report_invalid_blocks=False))
    assert failed_load(d) == len(PREFIX)


def test_bad_extra_config_key_fails_at_start_up(model) -> None:
    with pytest.raises(InvalidExtraConfig, match="cpu_blok"):
        Driver(vllm_config(model, {"cpu_blok": 3}, 16), FakeWorker())


def test_extra_config_contradicting_vllm_fails_at_start_up(model) -> None:
    with pytest.raises(InvalidExtraConfig, match="gpu_block_size"):
        Driver(vllm_config(model, {"cpu_blocks": 4, "gpu_block_size": 32}, 16), FakeWorker())


def test_kv_events_asked_for_while_vllm_publishes_none_fail_at_start_up(model) -> None:
    """`kv_events` follows vLLM's `kv_events_config`: recording events vLLM drops would only cost time."""
    with pytest.raises(InvalidExtraConfig, match="kv_events=True, but vLLM runs with False"):
        Driver(vllm_config(model, {"cpu_blocks": 4, "kv_events": True}, 16), FakeWorker())


def test_control_block_tables_that_miss_a_steps_new_blocks_are_caught(make_driver, monkeypatch) -> None:
    from kvfsm.integrations.vllm.convert import BlockTables

    def first_blocks_only(self, output) -> None:
        for req_data in output.scheduled_new_reqs:
            self._tables[req_data.req_id] = list(req_data.block_ids[0])

    monkeypatch.setattr(BlockTables, "update", first_blocks_only)
    d = make_driver()
    d.add("writer", PREFIX + [1, 2, 3], max_tokens=40)
    with pytest.raises(AssertionError, match="the adapter has writer's blocks as"):
        d.run()


def test_worker_metadata_of_another_connector_is_refused_naming_its_type(make_driver) -> None:
    d = make_driver()
    with pytest.raises(TypeError, match="expected kvfsm worker metadata, got object"):
        d.connector.scheduler_side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=object()))


def test_external_tokens_allocated_without_a_lookup_that_offered_them_are_refused_by_name(make_driver) -> None:
    d = make_driver()
    d.add("reader", PREFIX + [1])
    request = d.scheduler.requests["reader"]
    with pytest.raises(UnexpectedAllocation) as refused:
        d.connector.scheduler_side.update_state_after_alloc(request, None, BLOCK_SIZE)
    assert str(refused.value) == (f"vLLM allocated {BLOCK_SIZE} external tokens for 'reader' without a lookup that "
                                  "offered them")
