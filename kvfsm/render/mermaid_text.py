"""Mermaid text of the lifecycles and of their couplings, produced from the spec directly.

Mermaid needs no binary, so it is always written (CI machines have no `dot`), and GitHub renders it inline in
`docs/spec.md`.
"""

from __future__ import annotations

import re

from kvfsm.render.diagram_model import branches, diagram, transition_label
from kvfsm.spec import Lifecycle, Spec


def _mermaid_id(state: str) -> str:
    return re.sub(r"\W", "_", state)


def mermaid(lifecycle: Lifecycle) -> str:
    """The lifecycle as a Mermaid `stateDiagram-v2`: `[*]` marks the initial state and the exits of terminal ones."""
    drawn = diagram(branches(lifecycle))
    lines = ["stateDiagram-v2"]
    lines += [f'    state "{state}" as {_mermaid_id(state)}' for state in lifecycle.states]
    lines += [f"    state {_mermaid_id(choice.node)} <<choice>>" for choice in drawn.choices]
    lines.append(f"    [*] --> {_mermaid_id(lifecycle.initial)}")
    for edge in drawn.edges:
        lines.append(f"    {_mermaid_id(edge.source)} --> {_mermaid_id(edge.dest)}: {' | '.join(edge.labels)}")
    lines += [f"    {_mermaid_id(state)} --> [*]" for state in lifecycle.terminal]
    return "\n".join(lines) + "\n"


def couplings_mermaid(spec: Spec) -> str:
    """How the lifecycles move each other: one arrow per coupling, from the transition to the trigger it fires."""
    lines = ["flowchart LR"]
    lines += [f'    {_mermaid_id(name)}["{name}"]' for name in spec.lifecycles]
    for name, lc in spec.lifecycles.items():
        for t in lc.transitions:
            for c in t.couplings:
                when = transition_label(t.trigger, t.guards, ())
                lines.append(f'    {_mermaid_id(name)} -- "{when} → {c.fire} ({c.relation})" --> '
                             f"{_mermaid_id(c.lifecycle)}")
    return "\n".join(lines) + "\n"
