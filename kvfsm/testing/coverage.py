"""Edge coverage from the spec's state graph: the shortest trigger path to every declared transition.

Each path is replayed on the machines with a probe model whose guard outcomes are chosen per step, so a declared
transition that no path reaches (or that a machine refuses) is found from the spec alone; and the transitions the
generated interleavings took are compared against the same list.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvfsm.registry import Registry
from kvfsm.spec import Coupling, Lifecycle, Spec

Edge = tuple[str, str, str, str]  # lifecycle, source, trigger, dest


def declared_edges(spec: Spec) -> set[Edge]:
    return {(lc.name, source, t.trigger, t.dest)
            for lc in spec.lifecycles.values() for t in lc.transitions for source in t.source}


def shortest_paths(lifecycle: Lifecycle) -> dict[Edge, list[Edge]]:
    """For every declared transition, the shortest sequence of transitions from the initial state through it."""
    to_state: dict[str, list[Edge]] = {lifecycle.initial: []}
    frontier = deque([lifecycle.initial])
    while frontier:
        state = frontier.popleft()
        for t in lifecycle.transitions:
            if state in t.source and t.dest not in to_state:
                to_state[t.dest] = [*to_state[state], (lifecycle.name, state, t.trigger, t.dest)]
                frontier.append(t.dest)
    return {
        (lifecycle.name, source, t.trigger, t.dest): [*to_state[source], (lifecycle.name, source, t.trigger, t.dest)]
        for t in lifecycle.transitions
        for source in t.source
        if source in to_state
    }


@dataclass
class Probe:
    """A model whose guards say what the test chose and whose effects are logged, for any lifecycle."""

    state: str
    guard_values: dict[str, bool] = field(default_factory=dict)
    effects: list[str] = field(default_factory=list)


class ProbeRegistry(Registry):
    """A registry whose couplings are logged on the probe like effects (a probe has no ledger to move)."""

    def coupled(self, lifecycle: str, coupling: Coupling) -> Callable[..., None]:
        name = str(coupling)
        return lambda model, **_: model.effects.append(name)


def probe_registry(spec: Spec) -> Registry:
    """Every guard reads `Probe.guard_values`; every effect and coupling appends its name to `Probe.effects`."""
    registry = ProbeRegistry()
    for lc in spec.lifecycles.values():
        for t in lc.transitions:
            for g in t.guards:
                registry.guards[(lc.name, g)] = lambda model, _g=g, **_: model.guard_values.get(_g, False)
            for e in t.effects:
                registry.effects[(lc.name, e)] = lambda model, _e=e, **_: model.effects.append(_e)
    return registry


def guards_choosing(lifecycle: Lifecycle, edge: Edge) -> dict[str, bool]:
    """Guard outcomes under which `edge` is the branch its (state, trigger) takes."""
    _, source, trigger, dest = edge
    wanted = next(b for b in lifecycle.branches(source, trigger) if b.dest == dest)
    return {g: True for g in wanted.guards}
