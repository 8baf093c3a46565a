"""Machines built from the spec: the transitions-library machine, and a compiled table for the hot path.

Both are derived from the same `Lifecycle`; nothing here names a state or a trigger. The transitions machine is
the reference (it is what the library's semantics say the spec means); the compiled table is what the runtime
uses, because a transitions trigger costs ~9 µs and a dict lookup ~0.2 µs. `tests/test_machines.py` proves with
hypothesis that the two agree on every (state, trigger, guard outcome), refusals included.

Models are never registered with a transitions machine (`add_model` is quadratic in the number of models):
one machine per lifecycle fires events on any object with a `state` attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from itertools import compress
from typing import Any, Callable, Iterable, Iterator, Literal

from transitions import Machine, MachineError

from kvfsm.bindings import default_registry, default_spec
from kvfsm.registry import BatchEffect, Registry, batch_form, written_for_batches
from kvfsm.spec import Lifecycle, Spec

from kvfsm.machine_base import Branch, GuardRefused, IllegalTrigger, LifecycleMachine, Observer, Stateful

__all__ = ["Branch", "CompiledLifecycle", "GuardRefused", "IllegalTrigger", "LifecycleMachine", "MachineSet",
           "Observer", "Stateful", "TransitionsLifecycle", "default_machines"]


@dataclass(frozen=True)
class _Tables:
    """A lifecycle's compiled tables; read-only once built, so every machine of the same lifecycle shares them."""

    table: dict[tuple[str, str], tuple[Branch, ...]]
    moves: dict[str, dict[str, tuple[str, tuple[BatchEffect, ...]]]]
    """Per trigger, the states it leaves by one unguarded branch whose effects are written for batches: a batch
    moves those without trying guards, and runs the branch's effects once over the run of models that took it."""
    plain: dict[str, dict[str, str]]
    """Triggers whose every move is unguarded and has no effect (a store's submit, its completion): a batch of
    those is a lookup and an assignment per model."""
    guarded: dict[str, dict[str, tuple[Branch, ...]]]
    batch_guarded: dict[str, dict[str, tuple[Branch, ...]]]
    """Per trigger, the guarded states whose every branch has guards and effects written for batches."""


def _compile(lifecycle: Lifecycle, registry: Registry) -> _Tables:
    table: dict[tuple[str, str], tuple[Branch, ...]] = {}
    for state in lifecycle.states:
        for trigger in lifecycle.triggers:
            branches = lifecycle.branches(state, trigger)
            if branches:
                table[(state, trigger)] = tuple(CompiledLifecycle._branch(lifecycle.name, t, registry)
                                                for t in branches)
    moves = {
        trigger: {
            state: (branches[0].dest, branches[0].batch_effects)
            for (state, t), branches in table.items()
            if t == trigger and len(branches) == 1 and not branches[0].guards and branches[0].batched
        }
        for trigger in lifecycle.triggers
    }
    plain = {
        trigger: {state: dest for state, (dest, effects) in by_state.items()}
        for trigger, by_state in moves.items()
        if len(by_state) == sum(t == trigger for _, t in table) and not any(e for _, e in by_state.values())
    }
    guarded = {
        trigger: {state: b for (state, t), b in table.items() if t == trigger and state not in by_state}
        for trigger, by_state in moves.items()
    }
    batch_guarded = {
        trigger: {state: bs for state, bs in by_state.items()
                  if all(b.batch_guards is not None and b.batched for b in bs)}
        for trigger, by_state in guarded.items()
    }
    return _Tables(table, moves, plain, guarded, batch_guarded)


_COMPILED: dict[tuple[int, int], tuple[Lifecycle, Registry, _Tables]] = {}
_COMPILED_KEEP = 64
"""How many (lifecycle, registry) pairs keep their tables. An entry holds both objects, so no live object can
share its ids; the spec-mutant battery makes hundreds of specs, hence a bound rather than a cache of all."""


def _tables_of(lifecycle: Lifecycle, registry: Registry) -> _Tables:
    """The lifecycle's tables, compiled once per (lifecycle, registry): generated interleavings and the explorer
    build a connector per example or replay, and compiling each time was a third of the explorer's run."""
    key = (id(lifecycle), id(registry))
    kept = _COMPILED.get(key)
    if kept is not None and kept[0] is lifecycle and kept[1] is registry:
        return kept[2]
    tables = _compile(lifecycle, registry)
    if len(_COMPILED) >= _COMPILED_KEEP:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[key] = (lifecycle, registry, tables)
    return tables


class CompiledLifecycle(LifecycleMachine):
    """A lifecycle compiled to `(state, trigger) -> branches`: one dict lookup and the guards, per transition."""

    def __init__(self, lifecycle: Lifecycle, registry: Registry) -> None:
        self.lifecycle = lifecycle
        self.observers = []
        tables = _tables_of(lifecycle, registry)
        self.table = tables.table
        self._moves = tables.moves
        self._plain = tables.plain
        self._guarded = tables.guarded
        self._batch_guarded = tables.batch_guarded

    @staticmethod
    def _branch(lifecycle: str, transition: Any, registry: Registry) -> Branch:
        effects = tuple(registry.effects[(lifecycle, e)] for e in transition.effects) + tuple(
            registry.coupled(lifecycle, c) for c in transition.couplings)
        guards = tuple(registry.guards[(lifecycle, g)] for g in transition.guards)
        return Branch(dest=transition.dest, guards=guards, effects=effects, guard_names=transition.guards,
                      batch_guards=tuple(g.batch for g in guards)
                      if all(map(written_for_batches, guards)) else None,
                      batch_effects=tuple(batch_form(e) for e in effects),
                      batched=all(map(written_for_batches, effects)))

    def fire(self, model: Stateful, trigger: str, **context: Any) -> str:
        source = model.state
        branches = self.table.get((source, trigger))
        if branches is None:
            raise IllegalTrigger(self.lifecycle.name, source, trigger)
        for branch in branches:
            for guard in branch.guards:
                if not guard(model, **context):
                    break
            else:
                model.state = branch.dest
                for effect in branch.effects:
                    effect(model, **context)
                if self.observers:
                    self._notify(model, source, trigger)
                return branch.dest
        refused = " / ".join("+".join(b.guard_names) for b in branches)
        raise GuardRefused(self.lifecycle.name, source, trigger, f"no guard holds: {refused}")

    def fire_many(self, models: Iterable[Stateful], trigger: str, **context: Any) -> None:
        """Fire `trigger` on each model in order, with the outcome of calling `fire` on each.

        A batch of blocks (a store's slots, a load's slots) pays per block only a comparison of its state with the
        first block's and an assignment (`_move_leading_run`), or past that run a lookup by its state: consecutive
        models that leave their states by the same unguarded branch form a run, and that branch's effects run once
        over the run (written over batches, they equal a call per model in order: see `kvfsm.registry.of_batch`).
        A guarded model ends the run before its guards are asked, so a guard reads what every model before it left.
        A refusal is re-raised by `fire` itself, so it carries the same exception and message; the models before it
        have moved, with their effects, those after it have not. With an observer attached every model goes through
        `fire`, which reports each transition after its effects.
        """
        moves = self._moves.get(trigger)
        if moves is None or self.observers:  # a trigger the lifecycle lacks (`fire` raises), or a trace to report
            for model in models:
                self.fire(model, trigger, **context)
            return
        models = models if type(models) is list else list(models)
        moved = self._move_leading_run(models, moves, context)
        if moved == len(models):
            return
        if moved:
            models = models[moved:]
        plain = self._plain.get(trigger)
        if plain is not None:
            for model in models:
                dest = plain.get(model.state)
                if dest is None:
                    self.fire(model, trigger, **context)  # raises the refusal `fire` would
                model.state = dest  # type: ignore[assignment]
            return
        guarded = self._guarded[trigger]
        if not context:
            batch_guarded = self._batch_guarded[trigger]
            if (len(models) > 1 and models[0].state in batch_guarded  # a lone model: its guards in turn, cheaper
                    and self._fire_guarded_batch(models, batch_guarded)):
                return
        run: list[Stateful] = []
        current: tuple[str, tuple[BatchEffect, ...]] | None = None
        for model in models:
            move = moves.get(model.state)
            if move is not current:
                if run:
                    for effect in current[1]:  # type: ignore[index]
                        effect(run, **context)
                    run = []
                current = move
            if move is not None:
                model.state = move[0]
                run.append(model)
            elif context:
                self._fire_guarded(model, trigger, guarded, context)
            else:  # a guarded batch (a job's GPU fences) with no keyword arguments to pass
                for branch in guarded.get(model.state, ()):
                    for guard in branch.guards:
                        if not guard(model):
                            break
                    else:
                        model.state = branch.dest
                        for effect in branch.batch_effects:
                            effect((model,))
                        break
                else:
                    self.fire(model, trigger)  # raises the refusal `fire` would
        if run:
            for effect in current[1]:  # type: ignore[index]
                effect(run, **context)

    @staticmethod
    def _move_leading_run(models: list[Stateful], moves: dict[str, tuple[str, tuple[BatchEffect, ...]]],
                          context: dict[str, Any]) -> int:
        """Move the leading models in the first one's state by its unguarded branch, if it has one, and run the
        branch's effects once over them; returns how many moved. A job's slots or fences nearly always share one
        state: a comparison per model finds this run, where `fire_many`'s loop looks each model's move up."""
        move = moves.get(models[0].state) if models else None
        if move is None:
            return 0
        state, (dest, effects), moved = models[0].state, move, 0
        for model in models:
            if model.state != state:  # another state, or a model named twice and moved already: the run ends
                break
            model.state = dest
            moved += 1
        run = models if moved == len(models) else models[:moved]
        for effect in effects:
            effect(run, **context)
        return moved

    @staticmethod
    def _fire_guarded_batch(models: list[Stateful], batch_guarded: dict[str, tuple[Branch, ...]]) -> bool:
        """Move a batch of distinct models, all in one state that the trigger leaves by guarded branches whose guards
        and effects are written for batches (a job's GPU fences), asking each guard once for the whole batch.

        Each model takes the first branch whose guards hold for it, as `fire` would: with distinct models and guards
        that read only their model, a verdict asked of the batch is the one asked of the model in turn. Returns
        False, having moved nothing, when the batch is not of that kind or some model would be refused (the caller
        then fires one model at a time, which moves the models before the refusal and raises it)."""
        state = models[0].state
        branches = batch_guarded[state]
        if [m for m in models if m.state != state] or len(set(map(id, models))) != len(models):
            return False
        undecided, takes = models, []
        for branch in branches:
            taking = undecided
            for guard in branch.batch_guards:  # type: ignore[union-attr]
                verdicts = guard(taking)
                if not all(verdicts):  # a guard that holds for every model (the common case) keeps the batch whole
                    taking = list(compress(taking, verdicts)) if any(verdicts) else []
            takes.append(taking)
            if len(taking) == len(undecided):
                undecided = []
                break
            if taking:
                taken = set(map(id, taking))
                undecided = [model for model in undecided if id(model) not in taken]
        if undecided:
            return False
        for branch, taking in zip(branches, takes):
            if taking:
                for model in taking:
                    model.state = branch.dest
                for effect in branch.batch_effects:
                    effect(taking)
        return True

    def _fire_guarded(self, model: Stateful, trigger: str, guarded: dict[str, tuple[Branch, ...]],
                      context: dict[str, Any]) -> None:
        """One model of a batch whose state the trigger leaves only by guarded branches (or not at all)."""
        for branch in guarded.get(model.state, ()):
            for guard in branch.guards:
                if not guard(model, **context):
                    break
            else:
                model.state = branch.dest
                for effect in branch.effects:
                    effect(model, **context)
                return
        self.fire(model, trigger, **context)  # raises the refusal `fire` would


class TransitionsLifecycle(LifecycleMachine):
    """The same lifecycle as a `transitions.Machine`; the reference semantics and the source of diagrams."""

    def __init__(self, lifecycle: Lifecycle, registry: Registry, machine_cls: type[Machine] = Machine,
                 **machine_kwargs: Any) -> None:
        self.lifecycle = lifecycle
        self.observers = []
        name = lifecycle.name
        self.machine = machine_cls(
            model=None,
            states=list(lifecycle.states),
            initial=lifecycle.initial,
            transitions=[
                {
                    "trigger": t.trigger,
                    "source": list(t.source),
                    "dest": t.dest,
                    "conditions": [_on_event(registry.guards[(name, g)], g) for g in t.guards],
                    "after": [_on_event(registry.effects[(name, e)], e) for e in t.effects]
                    + [_on_event(registry.coupled(name, c), str(c)) for c in t.couplings],
                }
                for t in lifecycle.transitions
            ],
            auto_transitions=False,
            ignore_invalid_triggers=False,
            send_event=True,
            **machine_kwargs,
        )

    def fire(self, model: Stateful, trigger: str, **context: Any) -> str:
        source = model.state
        event = self.machine.events.get(trigger)
        if event is None:
            raise IllegalTrigger(self.lifecycle.name, source, trigger)
        try:
            moved = event.trigger(model, **context)
        except MachineError as err:
            raise IllegalTrigger(self.lifecycle.name, source, trigger) from err
        if not moved:
            raise GuardRefused(self.lifecycle.name, source, trigger, "no guard holds")
        if self.observers:
            self._notify(model, source, trigger)
        return model.state


class _on_event:
    """Adapts a registry function `(model, **context)` to transitions' `send_event=True` callback shape."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn, self.__name__ = fn, name

    def __call__(self, event: Any) -> Any:
        return self.fn(event.model, **event.kwargs)


Backend = Literal["table", "transitions"]


class MachineSet:
    """One machine per lifecycle of a spec, all on the same backend."""

    def __init__(self, spec: Spec, registry: Registry | None = None, backend: Backend = "table") -> None:
        registry = registry or default_registry()
        cls = CompiledLifecycle if backend == "table" else TransitionsLifecycle
        self.spec = spec
        self.backend = backend
        self.machines: dict[str, LifecycleMachine] = {
            name: cls(lifecycle, registry) for name, lifecycle in spec.lifecycles.items()
        }

    def __getitem__(self, lifecycle: str) -> LifecycleMachine:
        return self.machines[lifecycle]

    def __iter__(self) -> Iterator[LifecycleMachine]:
        return iter(self.machines.values())

    def observe(self, observer: Observer) -> None:
        for machine in self:
            machine.observers.append(observer)

    def unobserve(self, observer: Observer) -> None:
        for machine in self:
            machine.observers.remove(observer)


@cache
def default_machines() -> MachineSet:
    """One compiled machine set of the shipped spec, for callers that move lone records (tests, tools).

    A connector builds its own set (`MachineSet(default_spec())`), so an observer sees one connector's objects.
    """
    return MachineSet(default_spec())
