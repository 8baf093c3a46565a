"""Failed transfers in a whole engine: a failed load is recomputed, a failed store publishes nothing.

The Harness checks every named invariant, the bytes of every ready CPU block and, once drained, that each
request's tokens equal the run without offloading; each test adds the numbers its rule is about. A control is
the same scenario with one rule removed, and the test asserts the checks catch it. The shared scenario helpers are
in `engine_scenarios.py`.
"""

from __future__ import annotations

from kvfsm.testing.harness import Harness

from engine_scenarios import PREFIX, finish, harness, offload, on_results, step_lagging


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
