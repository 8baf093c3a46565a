"""Where the names used by `kvfsm/lifecycles/` are bound to Python: guards, effects and invariants.

The spec only names things; this registry says what each name does. The loader refuses a spec that names a
guard, effect or invariant missing here, so a typo in YAML is an error at load time, not a silently skipped check.
Guards and effects are scoped by lifecycle (two lifecycles may reuse a name for different rules); invariants are
system-wide predicates over a `kvfsm.invariants.World`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

Guard = Callable[..., bool]
Effect = Callable[..., None]
Invariant = Callable[[Any], list[str]]


@dataclass
class Registry:
    guards: dict[tuple[str, str], Guard] = field(default_factory=dict)
    effects: dict[tuple[str, str], Effect] = field(default_factory=dict)
    invariants: dict[str, Invariant] = field(default_factory=dict)

    def guard(self, lifecycle: str, name: str) -> Callable[[Guard], Guard]:
        def register(fn: Guard) -> Guard:
            self.guards[(lifecycle, name)] = fn
            return fn

        return register

    def effect(self, lifecycle: str, name: str) -> Callable[[Effect], Effect]:
        def register(fn: Effect) -> Effect:
            self.effects[(lifecycle, name)] = fn
            return fn

        return register

    def invariant(self, name: str) -> Callable[[Invariant], Invariant]:
        def register(fn: Invariant) -> Invariant:
            self.invariants[name] = fn
            return fn

        return register

    def has_guard(self, lifecycle: str, name: str) -> bool:
        return (lifecycle, name) in self.guards

    def has_effect(self, lifecycle: str, name: str) -> bool:
        return (lifecycle, name) in self.effects

    def has_invariant(self, name: str) -> bool:
        return name in self.invariants


REGISTRY = Registry()

"""The instance `kvfsm.records` and `kvfsm.invariants` register into; `kvfsm.bindings` imports them all."""
