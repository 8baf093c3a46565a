"""Where the names used by `spec/` are bound to Python: guards, effects and invariants.

The spec only names things; this registry says what each name does. The loader refuses a spec that names a
guard, effect or invariant missing here, so a typo in YAML is an error at load time, not a silently skipped check.
Guards, effects and relations (what a coupling's `of` names) are scoped by lifecycle (two lifecycles may reuse a
name for different rules); invariants are system-wide predicates over a `kvfsm.invariants.World`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

Guard = Callable[..., bool]
Effect = Callable[..., None]
BatchEffect = Callable[..., None]
"""An effect applied to a batch of models at once: `(models, **context)`, the same as applying it to each in order."""
Invariant = Callable[[Any], list[str]]
Relation = Callable[[Any], Iterable[Any]]
"""The keys of the objects a coupling moves, read from the model whose transition fires it (a job's CPU slots)."""


def of_batch(batch: BatchEffect, name: str) -> Effect:
    """An effect written for batches (`batch(models, **context)`), as an effect on one model (a batch of one); the
    batch form stays reachable as its `batch` attribute, which is what the machines call for a batch.

    A batch of CPU slots or GPU fences moves tens of thousands of models a second; an effect written over the batch
    pays one call per batch instead of one (with its keyword arguments) per model. Such an effect must touch only
    the models it is given and read no model's state: then applying it to a batch equals applying it to each model
    in order, which `tests/test_manager_fire_many.py` checks through the machines."""
    def one(model: Any, **context: Any) -> None:
        batch((model,), **context)

    one.batch, one.__name__ = batch, name  # type: ignore[attr-defined]
    return one


def guard_of_batch(batch: Callable[..., Sequence[bool]], name: str) -> Guard:
    """A guard written for batches (`batch(models, **context)`: one verdict per model), as a guard of one model,
    its batch form as its `batch` attribute. Like `of_batch`, it must read only the models it is given: a machine
    asks it once for a batch of distinct models all in one state, where that equals asking each model in turn."""
    def one(model: Any, **context: Any) -> bool:
        return batch((model,), **context)[0]

    one.batch, one.__name__ = batch, name  # type: ignore[attr-defined]
    return one


def written_for_batches(fn: Callable[..., Any]) -> bool:
    """Whether a guard or effect was registered with `batch=True` (`of_batch`, `guard_of_batch`)."""
    return hasattr(fn, "batch")


def batch_form(effect: Effect) -> BatchEffect:
    """`effect` over a batch of models: its own batch form if it was written for batches, else a call per model."""
    batch = getattr(effect, "batch", None)
    if batch is not None:
        return batch  # type: ignore[no-any-return]

    def each(models: Sequence[Any], **context: Any) -> None:
        for model in models:
            effect(model, **context)

    return each


class Coupled:
    """A spec coupling bound as an effect: after its transition, fire `trigger` on the related objects.

    The objects live in a ledger (one per connector) passed in the firing context as `ledger`; a machine fired
    with no ledger (the worker half's own job records, a lone record in a test) moves its one object alone.
    """

    __slots__ = ("lifecycle", "trigger", "relation", "__name__")

    def __init__(self, lifecycle: str, trigger: str, relation: Relation, name: str) -> None:
        self.lifecycle, self.trigger, self.relation, self.__name__ = lifecycle, trigger, relation, name

    def __call__(self, model: Any, ledger: Any = None, **context: Any) -> None:
        if ledger is not None:
            context["cause"] = model
            ledger.couple(self.lifecycle, self.trigger, self.relation(model), ledger=ledger, **context)


@dataclass
class Registry:
    guards: dict[tuple[str, str], Guard] = field(default_factory=dict)
    effects: dict[tuple[str, str], Effect] = field(default_factory=dict)
    invariants: dict[str, Invariant] = field(default_factory=dict)
    relations: dict[tuple[str, str], Relation] = field(default_factory=dict)

    def guard(self, lifecycle: str, name: str, batch: bool = False) -> Callable[[Guard], Guard]:
        """Bind a guard; `batch=True`: `fn` gives a verdict per model of a batch (`guard_of_batch`), else one."""
        def register(fn: Guard) -> Guard:
            self.guards[(lifecycle, name)] = guard_of_batch(fn, name) if batch else fn
            return fn

        return register

    def effect(self, lifecycle: str, name: str, batch: bool = False) -> Callable[[Effect], Effect]:
        """Bind an effect; `batch=True`: `fn` takes a batch of models (`of_batch`), else one model."""
        def register(fn: Effect) -> Effect:
            self.effects[(lifecycle, name)] = of_batch(fn, name) if batch else fn
            return fn

        return register

    def relation(self, lifecycle: str, name: str) -> Callable[[Relation], Relation]:
        def register(fn: Relation) -> Relation:
            self.relations[(lifecycle, name)] = fn
            return fn

        return register

    def invariant(self, name: str) -> Callable[[Invariant], Invariant]:
        def register(fn: Invariant) -> Invariant:
            self.invariants[name] = fn
            return fn

        return register

    def coupled(self, lifecycle: str, coupling: Any) -> Effect:
        """The effect that carries out `coupling` (a `kvfsm.spec.Coupling` of a `lifecycle` transition)."""
        relation = self.relations[(lifecycle, coupling.relation)]
        return Coupled(coupling.lifecycle, coupling.fire, relation, str(coupling))

    def has_guard(self, lifecycle: str, name: str) -> bool:
        return (lifecycle, name) in self.guards

    def has_effect(self, lifecycle: str, name: str) -> bool:
        return (lifecycle, name) in self.effects

    def has_invariant(self, name: str) -> bool:
        return name in self.invariants

    def has_relation(self, lifecycle: str, name: str) -> bool:
        return (lifecycle, name) in self.relations


REGISTRY = Registry()

"""The instance `kvfsm.records` and `kvfsm.invariants` register into; `kvfsm.bindings` imports them all."""
