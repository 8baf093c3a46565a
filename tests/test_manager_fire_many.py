"""`CompiledLifecycle.fire_many` is `fire` on each model in order: same states, counters, trace and refusals.

Checked on the two lifecycles the connector fires in batches: CPU blocks (no guards) and GPU-block fences (whose
`unfence` branches are chosen by guards), with an observer attached (each model through `fire`) and without one
(runs of models whose effects, written over batches, run once per run), a model named twice in a batch included;
and on small test lifecycles of the shapes the shipped ones lack.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field
from typing import Any, Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.bindings import default_registry
from kvfsm.machines import CompiledLifecycle, IllegalTrigger, default_machines
from kvfsm.records import CpuBlock, GpuBlock
from kvfsm.registry import Registry
from kvfsm.spec import Lifecycle

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
        # New tables, not the shipped ones edited: every machine of the lifecycle shares those.
        self._moves = {trigger: {state: (dest, tuple(lambda run, _e=e, **c: _e(run[:1], **c) for e in effects))
                                 for state, (dest, effects) in moves.items()}
                       for trigger, moves in self._moves.items()}


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
    "with a refused block ahead of a fenced one": ([[], ["fence"]], [0, 1]),
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


# lifecycles of other shapes ----------------------------------------------------------------------------------


@dataclass
class Token:
    """A model of the small lifecycles below: a count their guards read, and what their effects wrote."""

    n: int
    state: str = "a"
    marks: list[str] = field(default_factory=list)


def _within(tokens: Sequence[Token], *, limit: int, **_: object) -> list[bool]:
    return [token.n <= limit for token in tokens]


def _stamp(tokens: Sequence[Token], *, job_id: int, **_: object) -> None:
    for token in tokens:
        token.marks.append(f"job {job_id}")


def token_registry() -> Registry:
    """Guards and effects of the token lifecycles: some written for batches, some reading the firing's context."""
    registry = Registry()
    registry.guard("token", "positive")(lambda token, **_: token.n > 0)
    registry.guard("token", "over-one", batch=True)(lambda tokens, **_: [t.n > 1 for t in tokens])
    registry.guard("token", "at-least-one", batch=True)(lambda tokens, **_: [t.n >= 1 for t in tokens])
    registry.guard("token", "within", batch=True)(_within)
    registry.effect("token", "stamp", batch=True)(_stamp)
    return registry


def token_machine(*transitions: dict[str, Any]) -> CompiledLifecycle:
    states = {t["dest"] for t in transitions}  # each state of these lifecycles is entered by some transition
    lifecycle = Lifecycle.model_validate({"lifecycle": "token", "description": "a test lifecycle", "initial": "a",
                                          "states": dict.fromkeys(states, "a test state"),
                                          "transitions": transitions})
    return CompiledLifecycle(lifecycle, token_registry())


PLAIN_BESIDE_GUARDED = (
    {"trigger": "go", "source": "a", "dest": "b"},
    {"trigger": "go", "source": "b", "dest": "c", "guards": ["positive"]},
    {"trigger": "back", "source": "c", "dest": "a"},
)
"""`go` leaves `a` by a plain move and `b` by a guard not written for batches."""

OVERLAPPING_GUARDS = (
    {"trigger": "go", "source": "a", "dest": "b", "guards": ["over-one"]},
    {"trigger": "go", "source": "a", "dest": "c", "guards": ["at-least-one"]},
    {"trigger": "back", "source": ["b", "c"], "dest": "a"},
)
"""Both guards of `go` hold for a token above one: the first declared branch must take it."""

READS_CONTEXT = (
    {"trigger": "go", "source": "a", "dest": "b", "guards": ["within"], "effects": ["stamp"]},
    {"trigger": "back", "source": "b", "dest": "a"},
)
"""A guard and an effect, both written for batches, that read keyword arguments of the firing."""

TOKEN_BATCHES: dict[str, tuple[tuple[dict[str, Any], ...], list[Token], dict[str, Any]]] = {
    "a plain move then a guarded one": (PLAIN_BESIDE_GUARDED, [Token(0, "a"), Token(1, "b")], {}),
    "of guards not written for batches": (PLAIN_BESIDE_GUARDED, [Token(1, "b"), Token(2, "b")], {}),
    "split between overlapping guards": (OVERLAPPING_GUARDS, [Token(2), Token(1)], {}),
    "with a token no guard admits": (OVERLAPPING_GUARDS, [Token(1), Token(0)], {}),
    "whose guards and effects read the context": (READS_CONTEXT, [Token(1), Token(5)], {"limit": 3, "job_id": 7}),
}
"""Batches of `go` on lifecycles other than the shipped ones: (transitions, tokens, keyword arguments)."""


@pytest.mark.parametrize("case", sorted(TOKEN_BATCHES))
def test_fire_many_equals_fire_on_each_for_lifecycles_of_other_shapes(case: str) -> None:
    """The shipped lifecycles leave some paths of `fire_many` untried (a trigger both plain and guarded, guards that
    overlap or leave a model out, a context read by guards): these lifecycles take each of them."""
    transitions, tokens, context = TOKEN_BATCHES[case]
    machine = token_machine(*transitions)
    batch = list(range(len(tokens)))
    one_by_one = [Token(t.n, t.state) for t in tokens]
    batched = [Token(t.n, t.state) for t in tokens]
    assert (unobserved_outcome(machine, lambda ms: machine.fire_many(ms, "go", **context), batched, batch)
            == unobserved_outcome(machine, lambda ms: [machine.fire(m, "go", **context) for m in ms], one_by_one,
                                  batch))
