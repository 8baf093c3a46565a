"""How the connector is put together, seen through a whole engine: both machine backends run it alike, the pool
fires through the injected machine set, and per-layer loads and stores run in the step they belong to.

The Harness checks every named invariant, the bytes of every ready CPU block and, once drained, that each
request's tokens equal the run without offloading; each test adds the numbers its rule is about. A control is
the same scenario with one rule removed, and the test asserts the checks catch it. The shared scenario helpers are
in `engine_scenarios.py`.
"""

from __future__ import annotations

import pytest

from kvfsm.bindings import default_spec
from kvfsm.executor.sim import SimDevice
from kvfsm.machines import MachineSet
from kvfsm.testing.harness import Harness

from engine_scenarios import PREFIX, SHAPE_LAYERS, finish, harness, offload


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
    queued = h.device.queued()["store"]
    assert [label for label in queued if label.startswith("store job")] == [
        f"store job 0 layer {i}" for i in range(SHAPE_LAYERS)]
    assert finish(h) == []
