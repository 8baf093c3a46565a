"""Connector behaviours that need a whole engine: the reference engine + kvfsm on a `SimDevice`, via the Harness.

The Harness checks every named invariant, the bytes of every ready CPU block and, once drained, that each
request's tokens equal the run without offloading; each test adds the numbers its rule is about. A control is
the same scenario with one rule removed, and the test asserts the checks catch it.
"""

from __future__ import annotations

from typing import Callable

import pytest

from kvfsm.bindings import default_spec
from kvfsm.connector.metadata import ConnectorMetadata, ConnectorOutput, LoadOrder, SchedulerOutput
from kvfsm.connector.scheduler import StepResult
from kvfsm.engine.engine import RequestIdInUse
from kvfsm.executor.sim import SimDevice
from kvfsm.invariants import Deferral
from kvfsm.machines import IllegalTrigger, MachineSet
from kvfsm.states import TransferJobState
from kvfsm.testing.harness import SHAPE, Harness
from kvfsm.testing.mutants import MUTANTS

SHAPE_LAYERS = SHAPE.num_layers
PREFIX = tuple(range(10, 28))
"""18 tokens: nine 2-token GPU blocks."""

Control = Callable[[Harness], None]


def harness(k: int = 1, gpu_blocks: int = 24, cpu_blocks: int = 16, control: Control | None = None) -> Harness:
    h = Harness(SimDevice(), num_gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks, block_size_factor=k)
    if control is not None:
        control(h)
    return h


def offload(h: Harness, prompt: tuple[int, ...] = PREFIX) -> None:
    """Run `prompt` to the end, then drop the GPU prefix cache: its prefix now lives only on CPU."""
    h.add_request(prompt, 1)
    h.drain()
    h.engine.reset_prefix_cache()


def finish(h: Harness) -> list[str]:
    h.drain()
    return h.final_violations()


def mutant(name: str) -> Control:
    return lambda h: MUTANTS[name].apply(h.engine, h.connector)


def on_results(h: Harness, hook: Callable[[StepResult], None]) -> None:
    """Let `hook` see (and, for a control, change) each StepResult before the engine acts on it."""
    update = h.connector.update_connector_output

    def hooked(output: ConnectorOutput) -> StepResult:
        result = update(output)
        hook(result)
        return result
    h.connector.update_connector_output = hooked  # type: ignore[method-assign]


def step_lagging(h: Harness) -> None:
    """One engine step with the device left where it is: the host runs ahead of the GPU."""
    h.engine.step()


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


# finished and aborted requests return their blocks at once, fenced lazily on reuse ---------------------------


def record_flushes(h: Harness) -> list[int]:
    """The stores each step's metadata flushes, as the steps run."""
    flushed: list[int] = []
    build = h.connector.scheduler.build_connector_meta

    def recorded(output: SchedulerOutput) -> ConnectorMetadata:
        meta = build(output)
        flushed.extend(meta.flush)
        return meta

    h.connector.scheduler.build_connector_meta = recorded  # type: ignore[method-assign]
    return flushed


def run_end_then_reuse(h: Harness, aborted: bool = False) -> tuple[list[str], set[str], tuple[int, ...]]:
    """A request finishes (or is aborted) with its stores in flight; another is handed its GPU blocks at once (a
    tight pool), with the host running ahead of the device. Returns the violations (after the reusing step, then
    after the drain), the requests the engine was told to release and the stores the reusing step flushed."""
    released: set[str] = set()
    on_results(h, lambda result: released.update(result.released))
    flushed = record_flushes(h)
    h.add_request(PREFIX[:12], 1 if not aborted else 4, "a")
    step_lagging(h)
    if aborted:
        h.abort("a")
    stores = tuple(j.job_id for j in h.connector.scheduler.requests["a"].jobs_in_flight)
    assert h.connector.scheduler.requests["a"].state == "returned" and stores
    assert "a" not in h.engine.live, "the engine kept the blocks of a request with only stores in flight"
    h.add_request(tuple(range(60, 72)), 3, "b")  # still running after the step it was handed the blocks
    step_lagging(h)
    scheduler = h.connector.scheduler
    assert set(scheduler.requests["b"].block_ids) & set(scheduler.jobs[stores[0]].gpu_blocks), \
        "the scenario needs b handed a block a's store reads"
    in_step = h.violations()  # the step that handed the blocks out, before the device ran the store
    return in_step + finish(h), released, tuple(j for j in flushed if j in stores)


def test_a_finished_request_returns_its_blocks_and_the_reusing_step_flushes_its_stores() -> None:
    found, released, flushed = run_end_then_reuse(harness(gpu_blocks=8))
    assert found == []
    assert "a" not in released, "a returned request's end is no news to the engine"
    assert flushed


def test_an_aborted_request_returns_its_blocks_and_the_reusing_step_flushes_its_stores() -> None:
    found, _, flushed = run_end_then_reuse(harness(gpu_blocks=8), aborted=True)
    assert found == [] and flushed


def test_a_finished_request_whose_blocks_nobody_takes_flushes_nothing() -> None:
    h = harness(gpu_blocks=24)
    flushed = record_flushes(h)
    h.add_request(PREFIX[:12], 1, "a")
    step_lagging(h)
    assert h.connector.scheduler.requests["a"].state == "returned"
    h.add_request(tuple(range(60, 72)), 1, "b")
    step_lagging(h)
    assert finish(h) == []
    assert flushed == [], "a store was waited for although nobody was handed the blocks it reads"


def test_the_id_of_a_request_whose_stores_are_in_flight_is_refused_until_they_end() -> None:
    h = harness()
    h.add_request(PREFIX[:12], 1, "a")
    step_lagging(h)
    assert h.connector.scheduler.requests["a"].state == "returned" and "a" not in h.engine.live
    with pytest.raises(RequestIdInUse, match="stores of that request are in flight"):
        h.engine.add_request("a", PREFIX[:12], 1)
    assert finish(h) == []
    h.add_request(PREFIX[:12], 1, "a")
    assert finish(h) == []


def test_dropping_the_lazy_fence_is_caught() -> None:
    found, _, flushed = run_end_then_reuse(harness(gpu_blocks=8, control=mutant("no-lazy-fence")))
    assert not flushed
    assert any(line.startswith("lazy-fence:") for line in found)
    assert any(line.startswith("fence:") for line in found)


def test_dropping_the_lazy_fence_after_an_abort_is_caught() -> None:
    found, _, _ = run_end_then_reuse(harness(gpu_blocks=8, control=mutant("no-lazy-fence")), aborted=True)
    assert any(line.startswith("fence:") for line in found)


# aborts, reused ids, reset ---------------------------------------------------------------------------------


def test_abort_while_loading_leaks_nothing() -> None:
    h = harness()
    offload(h)
    h.add_request(PREFIX, 2, "b")
    step_lagging(h)
    assert h.connector.scheduler.requests["b"].state == "loading"
    h.abort("b")
    assert finish(h) == []
    assert "b" not in h.engine.live


def test_abort_while_storing_leaks_nothing() -> None:
    h = harness()
    h.add_request(PREFIX, 3, "a")
    step_lagging(h)
    step_lagging(h)
    assert any(j.kind == "store" and j.in_flight for j in h.connector.scheduler.jobs.values())
    h.abort("a")
    assert finish(h) == []


def test_a_request_id_reused_after_it_finished_reloads_its_prefix() -> None:
    h = harness()
    offload(h)
    h.add_request(PREFIX, 2, "req-0")
    assert finish(h) == []
    assert h.engine.cpu_hit_tokens == 16


def test_reset_cache_with_stores_and_loads_in_flight_publishes_nothing() -> None:
    h = harness()
    offload(h)
    h.add_request(PREFIX, 1, "loader")  # loads the stored prefix
    h.add_request(tuple(range(60, 72)), 1, "storer")  # stores a new one
    step_lagging(h)
    step_lagging(h)
    scheduler = h.connector.scheduler
    caught = {j.job_id: j.kind for j in scheduler.jobs.values() if j.in_flight}
    h.connector.reset_cache()
    assert set(caught.values()) == {"load", "store"}
    assert scheduler.manager.catalogue == {}
    assert finish(h) == []
    published = {b.writer_job for b in scheduler.manager.blocks if b.state == "ready"}
    assert not published & set(caught), "a store in flight at the reset published its block"


# failed transfers ------------------------------------------------------------------------------------------


def run_failed_load(h: Harness) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    """The load of an offloaded prefix is refused as it is submitted; the engine must recompute those blocks."""
    errors: dict[str, tuple[int, ...]] = {}
    on_results(h, lambda result: errors.update(result.load_errors))
    offload(h)
    h.add_request(PREFIX, 2, "b")
    h.faults.arm("load")
    return finish(h), errors


def test_a_failed_load_is_recomputed_and_outputs_stay_correct() -> None:
    h = harness()
    found, errors = run_failed_load(h)
    assert found == []
    assert list(errors) == ["b"] and len(errors["b"]) == 8
    assert h.connector.scheduler.stats.loads_failed == 1


def test_an_engine_that_trusts_a_failed_load_is_caught() -> None:
    def hide_errors(h: Harness) -> None:
        """Control: the load errors never reach the engine, which computes on blocks that were never written."""
        on_results(h, lambda result: result.load_errors.clear())
    h = harness(control=hide_errors)
    found, _ = run_failed_load(h)
    assert any(line.startswith("output:") for line in found)


def test_a_failed_store_publishes_nothing_and_the_prefix_is_recomputed() -> None:
    h = harness()
    h.add_request(PREFIX, 1, "a")
    h.faults.arm("store")  # the store ordered in step 1 is checked as its forward ends, submitted in step 2
    step_lagging(h)
    assert finish(h) == []
    scheduler = h.connector.scheduler
    assert scheduler.stats.stores_failed == 1 and scheduler.manager.usage()["free"] == 16
    h.engine.reset_prefix_cache()
    h.add_request(PREFIX, 1, "b")
    assert finish(h) == [] and h.engine.cpu_hit_tokens == 0


def _busy_run(backend: str) -> tuple[set[tuple[str, str, str, str]], dict[str, int | float], list[str]]:
    """Stores, reloads, a preemption, an abort and a failed store, on the connector built with `backend`."""
    h = Harness(SimDevice(), num_gpu_blocks=24, cpu_blocks=16, backend=backend)  # type: ignore[arg-type]
    offload(h)
    first = h.add_request(PREFIX + (40, 41, 42, 43), 3)
    second = h.add_request(PREFIX + (50, 51), 3)
    h.engine.step()
    h.settle()
    h.faults.arm("store")
    h.add_request(tuple(range(60, 72)), 2)
    h.engine.step()
    h.settle()
    if h.engine.running:
        h.engine.preempt(h.engine.running[0].request_id)
    h.abort(second if first in h.engine.live else first)
    violations = finish(h)
    stats = {k: v for k, v in h.connector.scheduler.stats.as_dict().items() if not k.endswith("seconds")}
    h.close()
    return h.trace.edges, stats, violations


def test_both_backends_run_the_whole_connector_alike() -> None:
    """The machine set given to the connector is the one every half, the pool and every coupling fire through."""
    table, transitions = _busy_run("table"), _busy_run("transitions")
    assert table[2] == [] and transitions[2] == []
    assert table[0] == transitions[0] and table[1] == transitions[1]
    assert {e[0] for e in table[0]} == {"cpu-block", "gpu-block", "request", "transfer-job"}
    assert table[1]["blocks_loaded"] and table[1]["stores_failed"]


def test_a_pool_firing_through_machines_of_its_own_is_caught() -> None:
    """The control: a pool that ignores the injected machine set moves CPU blocks the connector's trace never sees."""
    h = harness()
    h.connector.scheduler.manager._machine = MachineSet(default_spec())["cpu-block"]
    offload(h)
    h.add_request(PREFIX + (40, 41), 2)
    finish(h)
    assert "cpu-block" not in {edge[0] for edge in h.trace.edges}
    h.close()


def per_layer_harness(layer_loads: bool = True, layer_stores: bool = False) -> Harness:
    return Harness(SimDevice(), num_gpu_blocks=24, cpu_blocks=16, per_layer=True, layer_loads=layer_loads,
                   layer_stores=layer_stores)


@pytest.mark.parametrize("poll_lag", [0, 1000], ids=["load reported later", "load landed within its step"])
def test_a_cpu_hit_is_computed_in_the_step_that_loads_it_layer_by_layer(poll_lag: int) -> None:
    h = per_layer_harness()
    offload(h)
    h.poll_lag = poll_lag
    h.add_request(PREFIX + (1,), 1)
    h.engine.step()
    assert h.engine.cpu_hit_tokens == 18 and h.engine.computed_tokens == len(PREFIX) + 1, "the tail ran this step"
    assert finish(h) == []
    labels = {a.label for a in h.device.accesses}
    assert {f"load job 1 layer {i}" for i in range(SHAPE_LAYERS)} <= labels


def test_control_the_same_step_without_layer_loads_waits_for_the_report() -> None:
    h = per_layer_harness(layer_loads=False)
    offload(h)
    h.add_request(PREFIX + (1,), 1)
    h.engine.step()
    assert h.engine.computed_tokens == len(PREFIX), "only the first prompt was computed: the reload waits"
    assert finish(h) == []


def test_per_layer_stores_start_behind_each_layers_write_and_store_the_right_bytes() -> None:
    h = per_layer_harness(layer_stores=True)
    h.add_request(PREFIX, 1)
    h.engine.step()
    queued = [op.label for op in h.device._queues["store"]]
    assert [label for label in queued if label.startswith("store job")] == [
        f"store job 0 layer {i}" for i in range(SHAPE_LAYERS)]
    assert finish(h) == []
