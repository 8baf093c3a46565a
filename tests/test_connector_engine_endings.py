"""How a request's end reaches the connector in a whole engine: finished and aborted requests return their blocks
at once (fenced lazily on reuse), aborts mid-transfer, reused ids and a cache reset leak nothing.

The Harness checks every named invariant, the bytes of every ready CPU block and, once drained, that each
request's tokens equal the run without offloading; each test adds the numbers its rule is about. A control is
the same scenario with one rule removed, and the test asserts the checks catch it. The shared scenario helpers are
in `engine_scenarios.py`.
"""

from __future__ import annotations

import pytest

from kvfsm.connector.metadata import ConnectorMetadata, SchedulerOutput
from kvfsm.engine.config import RequestIdInUse
from kvfsm.testing.harness import Harness

from engine_scenarios import PREFIX, finish, harness, mutant, offload, on_results, step_lagging


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
