"""What a lifecycle diagram shows, before any drawing: branches, choice points and labelled arrows.

Graphviz and Mermaid draw the same arrows; both take them from here, so the two pictures of a lifecycle agree on
what meets at a choice, which transitions share an arrow and how each label reads.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from kvfsm.spec import Lifecycle


def transition_label(trigger: str, guards: Sequence[str], effects: Sequence[str]) -> str:
    """A transition as UML writes it, `trigger [guard, ...] / effect, ...`; any part may be absent."""
    parts = [trigger] if trigger else []
    if guards:
        parts.append(f"[{', '.join(guards)}]")
    if effects:
        parts.append(f"/ {', '.join(effects)}")
    return " ".join(parts)


@dataclass(frozen=True)
class Branch:
    """One (source state, trigger) -> dest possibility: a spec transition from one of its sources."""

    source: str
    trigger: str
    dest: str
    guards: tuple[str, ...]
    effects: tuple[str, ...]


@dataclass(frozen=True)
class Choice:
    """A UML choice point: `trigger`, fired from a state with an arrow into it, goes where the first holding guard says."""

    node: str
    trigger: str


@dataclass(frozen=True)
class Edge:
    """One arrow between two nodes (states or choices), one label line per transition it stands for."""

    source: str
    dest: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class Diagram:
    choices: tuple[Choice, ...]
    edges: tuple[Edge, ...]


def branches(lifecycle: Lifecycle) -> list[Branch]:
    """The lifecycle's transitions, one per source state, in declaration order; couplings shown as effects."""
    return [
        Branch(source, t.trigger, t.dest, t.guards, t.effects + tuple(str(c) for c in t.couplings))
        for t in lifecycle.transitions for source in t.source
    ]


def diagram(all_branches: Iterable[Branch]) -> Diagram:
    """Arrows that stay readable: guarded alternatives meet at a choice, parallel transitions share an arrow.

    Drawn naively, `abort` from six states to two guarded destinations is twelve labelled arrows. A (source,
    trigger) with several branches instead gets one unlabelled arrow into a choice named by the trigger, and
    the choice one arrow per branch labelled with its guards and effects; sources whose branches are the same
    share the choice. The remaining single transitions between the same two states share one arrow.
    Arrows into a choice are labelled with the trigger, arrows out of it with their guards and effects.
    """
    by_firing: dict[tuple[str, str], list[Branch]] = defaultdict(list)
    for b in all_branches:
        by_firing[(b.source, b.trigger)].append(b)
    choice_sources: dict[tuple[str, tuple[tuple[str, str], ...]], list[str]] = defaultdict(list)
    labels: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (source, trigger), bs in by_firing.items():
        if len(bs) == 1:
            b = bs[0]
            labels[(source, b.dest)].append(transition_label(trigger, b.guards, b.effects))
        else:
            outs = tuple((b.dest, transition_label("", b.guards, b.effects)) for b in bs)
            choice_sources[(trigger, outs)].append(source)
    choices = []
    for index, ((trigger, outs), sources) in enumerate(choice_sources.items()):
        choice = Choice(f"choice-{index}-{trigger}", trigger)
        choices.append(choice)
        labels.update({(source, choice.node): [trigger] for source in sources})
        for dest, label in outs:
            labels[(choice.node, dest)].append(label)
    return Diagram(tuple(choices), tuple(Edge(s, d, tuple(ls)) for (s, d), ls in labels.items()))
