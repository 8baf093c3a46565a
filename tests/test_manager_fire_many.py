"""`CompiledLifecycle.fire_many` is `fire` on each model in order: same states, counters, trace and refusals.

Checked on the two lifecycles the connector fires in batches: CPU blocks (no guards) and GPU-block fences (whose
`unfence` branches are chosen by guards), with an observer attached (each model through `fire`) and without one
(runs of models whose effects, written over batches, run once per run), a model named twice in a batch included.
"""

from __future__ import annotations

from dataclasses import astuple
from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.bindings import default_registry
from kvfsm.machines import CompiledLifecycle, IllegalTrigger, default_machines
from kvfsm.records import CpuBlock, GpuBlock

MODELS: dict[str, Callable[[int], Any]] = {"cpu-block": CpuBlock, "gpu-block": GpuBlock}
"""The batched lifecycles and how to build a model of each from an id."""


class SkipsGuards(CompiledLifecycle):
    """Control: `fire_many` exactly as shipped (effects, observers) except that it takes the first branch of each
    (state, trigger) without asking its guards."""

    def fire_many(self, models: Any, trigger: str, **context: Any) -> None:
        for model in models:
            source = model.state
            branch = self.table[(source, trigger)][0]
            model.state = branch.dest
            for effect in branch.effects:
                effect(model, **context)
            self._notify(model, source, trigger)


def walked(lifecycle: str, index: int, walk: list[str]) -> Any:
    """A model moved from its initial state by the legal triggers of `walk` (illegal ones skipped)."""
    machine = default_machines()[lifecycle]
    model = MODELS[lifecycle](index)
    for trigger in walk:
        try:
            machine.fire(model, trigger, block_hash=index, job_id=index)
        except IllegalTrigger:
            pass
    return model


def run(machine: CompiledLifecycle, fire: Callable[[list[Any]], None], models: list[Any]) -> tuple:
    """Outcome of one batch: final fields, the trace the machine reported, and the refusal (type and message)."""
    trace: list[tuple] = []
    observer = lambda _lc, model, source, trigger, dest: trace.append((id(model), source, trigger, dest))  # noqa: E731
    machine.observers.append(observer)
    try:
        fire(models)
        refusal = None
    except IllegalTrigger as err:
        refusal = (type(err), str(err))
    finally:
        machine.observers.remove(observer)
    ids = {id(m): i for i, m in enumerate(models)}
    return [astuple(m) for m in models], [(ids[m], *rest) for m, *rest in trace], refusal


def batch_outcomes(machine: CompiledLifecycle, walks: list[list[str]], trigger: str) -> tuple[tuple, tuple]:
    """(fire on each, `machine.fire_many`) applied to two equal batches of models walked by `walks`."""
    lifecycle = machine.lifecycle.name
    reference = default_machines()[lifecycle]
    one_by_one = [walked(lifecycle, i, w) for i, w in enumerate(walks)]
    batched = [walked(lifecycle, i, w) for i, w in enumerate(walks)]

    def each(models: list[Any]) -> None:
        for model in models:
            reference.fire(model, trigger, block_hash=99, job_id=7)

    return (run(reference, each, one_by_one),
            run(machine, lambda models: machine.fire_many(models, trigger, block_hash=99, job_id=7), batched))


def unobserved_outcome(machine: CompiledLifecycle, fire: Callable[[list[Any]], None], models: list[Any],
                       batch: list[int]) -> tuple:
    """Final fields and refusal of firing on `models[i] for i in batch` with no observer attached."""
    try:
        fire([models[i] for i in batch])
        refusal = None
    except IllegalTrigger as err:
        refusal = (type(err), str(err))
    return [astuple(m) for m in models], refusal


def walks_of(lifecycle: str) -> st.SearchStrategy[tuple[list[list[str]], str]]:
    triggers = st.sampled_from(sorted(default_machines()[lifecycle].lifecycle.triggers))
    return st.tuples(st.lists(st.lists(triggers, max_size=8), min_size=1, max_size=8), triggers)


@pytest.mark.parametrize("lifecycle", sorted(MODELS))
@given(data=st.data())
def test_fire_many_equals_fire_on_each(lifecycle: str, data: st.DataObject) -> None:
    walks, trigger = data.draw(walks_of(lifecycle))
    each, batched = batch_outcomes(default_machines()[lifecycle], walks, trigger)
    assert batched == each


@pytest.mark.parametrize("lifecycle", sorted(MODELS))
@given(data=st.data())
def test_fire_many_without_observers_equals_fire_on_each(lifecycle: str, data: st.DataObject) -> None:
    walks, trigger = data.draw(walks_of(lifecycle))
    batch = data.draw(st.lists(st.integers(0, len(walks) - 1), min_size=1, max_size=12))  # repeats allowed
    machine = default_machines()[lifecycle]
    assert not machine.observers
    one_by_one = [walked(lifecycle, i, w) for i, w in enumerate(walks)]
    batched = [walked(lifecycle, i, w) for i, w in enumerate(walks)]

    def each(models: list[Any]) -> None:
        for model in models:
            machine.fire(model, trigger, block_hash=99, job_id=7)

    assert (unobserved_outcome(machine, lambda ms: machine.fire_many(ms, trigger, block_hash=99, job_id=7), batched,
                               batch)
            == unobserved_outcome(machine, each, one_by_one, batch))
    assert (unobserved_outcome(machine, lambda ms: machine.fire_many(ms, trigger), batched, batch)
            == unobserved_outcome(machine, lambda ms: [machine.fire(m, trigger) for m in ms], one_by_one, batch))


class EffectsOncePerRun(CompiledLifecycle):
    """Control: a run's effects applied to its first model only (as if a batch effect read one model)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        for trigger, moves in self._moves.items():
            for state, (dest, effects) in moves.items():
                moves[state] = (dest, tuple(lambda run, _e=e, **c: _e(run[:1], **c) for e in effects))


def test_control_whose_run_effects_skip_models_is_caught() -> None:
    machine = default_machines()["cpu-block"]
    control = EffectsOncePerRun(machine.lifecycle, default_registry())
    ready = [walked("cpu-block", i, ["allocate", "submit", "store-done"]) for i in range(2)]
    same = [walked("cpu-block", i, ["allocate", "submit", "store-done"]) for i in range(2)]
    control.fire_many(ready, "pin", job_id=7)
    machine.fire_many(same, "pin", job_id=7)
    assert [b.readers for b in same] == [1, 1] and [b.readers for b in ready] == [1, 0]


def test_control_that_skips_guards_is_caught_for_the_guard() -> None:
    machine = default_machines()["gpu-block"]
    control = SkipsGuards(machine.lifecycle, default_registry())
    # One store reads the block: `unfence` must make it writable; the first declared branch keeps it fenced.
    (fields, trace, refusal), (bad_fields, bad_trace, bad_refusal) = batch_outcomes(control, [["fence"]], "unfence")
    assert (fields, trace, refusal) != (bad_fields, bad_trace, bad_refusal)
    assert [f[1] for f in fields] == ["writable"] and [f[1] for f in bad_fields] == ["fenced"]
    assert [t[:3] for t in bad_trace] == [t[:3] for t in trace], "the control reports every transition it takes"
    assert bad_refusal is refusal is None


FENCE_BATCHES = {
    "split between the two unfence branches": ([["fence", "fence"], ["fence"], ["fence"]], [0, 1, 2]),
    "of mixed states, one refused": ([["fence"], []], [0, 1]),
    "naming one block twice": ([["fence", "fence"], ["fence"]], [0, 0, 1]),
}
"""Batches of GPU fences that the guarded batch path must decide as firing `unfence` on each in turn would."""


@pytest.mark.parametrize("case", sorted(FENCE_BATCHES))
def test_a_batch_of_fences_unfences_as_one_at_a_time_would(case: str) -> None:
    walks, batch = FENCE_BATCHES[case]
    machine = default_machines()["gpu-block"]
    one_by_one = [walked("gpu-block", i, w) for i, w in enumerate(walks)]
    batched = [walked("gpu-block", i, w) for i, w in enumerate(walks)]
    assert (unobserved_outcome(machine, lambda ms: machine.fire_many(ms, "unfence"), batched, batch)
            == unobserved_outcome(machine, lambda ms: [machine.fire(m, "unfence") for m in ms], one_by_one, batch))
