"""What every lifecycle machine shares, whichever backend builds it (`kvfsm.machines`): the interface the runtime
fires triggers through, its refusals, and a compiled branch. Apart from `machines.py` so that module holds the two
backends and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

from kvfsm.registry import BatchEffect
from kvfsm.spec import Lifecycle

Observer = Callable[[str, Any, str, str, str], None]
"""Called after every transition with (lifecycle, model, source, trigger, dest): the trace of a run."""


class IllegalTrigger(RuntimeError):
    """A trigger was fired in a state the spec gives it no transition from (or for a trigger the spec lacks)."""

    def __init__(self, lifecycle: str, state: str, trigger: str, detail: str = "") -> None:
        self.lifecycle, self.state, self.trigger = lifecycle, state, trigger
        msg = f"lifecycle {lifecycle!r}: trigger {trigger!r} is illegal in state {state!r}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class GuardRefused(IllegalTrigger):
    """The spec has transitions for (state, trigger), but none of their guards holds for this model."""


class Stateful(Protocol):
    state: str


@dataclass(frozen=True, slots=True)
class Branch:
    dest: str
    guards: tuple[Callable[..., bool], ...]
    effects: tuple[Callable[..., None], ...]
    guard_names: tuple[str, ...]
    batch_effects: tuple[BatchEffect, ...] = ()
    """The same effects over a batch of models (`kvfsm.registry.batch_form`), for `fire_many`."""
    batch_guards: tuple[Callable[..., Sequence[bool]], ...] | None = None
    """The guards over a batch of models, when every one was written for batches (`kvfsm.registry.guard_of_batch`)."""
    batched: bool = False
    """Every effect was written for batches (`kvfsm.registry.of_batch`): it may run once over a run of models after
    they all moved. A coupling is not: it moves other objects whose guards read this model's peers (a request
    counts its jobs still in flight), so it runs right after its own model's move."""


class LifecycleMachine:
    """What the runtime fires triggers through; both backends share this interface and its exceptions."""

    lifecycle: Lifecycle
    observers: list[Observer]

    def fire(self, model: Stateful, trigger: str, **context: Any) -> str:
        """Move `model` by `trigger`; returns the new state or raises `IllegalTrigger` / `GuardRefused`."""
        raise NotImplementedError

    def fire_many(self, models: Iterable[Stateful], trigger: str, **context: Any) -> None:
        """Fire `trigger` on each model in order, as `fire` would; a refusal leaves the later models unmoved."""
        for model in models:
            self.fire(model, trigger, **context)

    def _notify(self, model: Stateful, source: str, trigger: str) -> None:
        for observer in self.observers:
            observer(self.lifecycle.name, model, source, trigger, model.state)
