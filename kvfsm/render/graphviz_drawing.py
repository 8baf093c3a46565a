"""Graphviz pictures of a lifecycle, drawn through transitions' own diagram support.

The machine is built by `TransitionsLifecycle`, as the runtime builds it, so the picture shows what the library
thinks the spec means; only the arrows (from `diagram_model`), the styling and the legend are kvfsm's.
"""

from __future__ import annotations

import html
from typing import Any, Iterable, Mapping

import graphviz
from transitions.extensions.diagrams import GraphMachine
from transitions.extensions.diagrams_graphviz import Graph

from kvfsm.bindings import default_registry
from kvfsm.machines import TransitionsLifecycle
from kvfsm.render.diagram_model import Branch, diagram
from kvfsm.spec import Lifecycle

_FONT = "Helvetica"
_CHOICE_STYLE = {"shape": "diamond", "style": "filled", "fillcolor": "#fef3c7", "color": "#b45309",
                 "width": "0.3", "height": "0.3", "fixedsize": "true"}


class _SpecGraph(Graph):
    """transitions' graphviz graph, with the arrows of `diagram`: UML labels, choices, one arrow per state pair.

    The library would draw one arrow per (source, dest) with the labels of parallel transitions joined by " | " on
    one line, and without effects (`after` callbacks): for this spec, an unreadable and incomplete picture.
    """

    def _add_edges(self, transitions: Iterable[Mapping[str, Any]], container: graphviz.Digraph) -> None:
        drawn = diagram(
            Branch(t["source"], t["trigger"], t["dest"], tuple(t.get("conditions", ())), tuple(t.get("after", ())))
            for t in transitions
        )
        for choice in drawn.choices:
            container.node(choice.node, label="", tooltip=f"{choice.trigger}: the first branch whose guards hold",
                           **_CHOICE_STYLE)
        for edge in drawn.edges:
            container.edge(edge.source, edge.dest, label="".join(f"{line}\\l" for line in edge.labels))


class _SpecGraphMachine(GraphMachine):
    """A GraphMachine whose graphs are `_SpecGraph`s, styled for a printed reference rather than a live model."""

    machine_attributes = {
        "directed": "true",
        "strict": "false",
        "rankdir": "TB",
        "nodesep": "0.5",
        "ranksep": "0.9",
        "fontname": _FONT,
        "labelloc": "t",
    }
    style_attributes = {
        "node": {
            "default": {
                "style": "rounded,filled",
                "shape": "rectangle",
                "fillcolor": "white",
                "color": "black",
                "fontname": _FONT,
                "fontsize": "14",
                "margin": "0.15,0.08",
            },
            "initial": {"fillcolor": "#dbeafe", "color": "#1d4ed8", "penwidth": "2"},
            "terminal": {"fillcolor": "#dcfce7", "color": "#15803d", "peripheries": "2"},
        },
        "edge": {"default": {"fontname": _FONT, "fontsize": "11", "color": "#444444"}},
        "graph": {"default": {}},
    }

    def _init_graphviz_engine(self, graph_engine: str) -> type[Graph]:
        return _SpecGraph


def digraph(lifecycle: Lifecycle) -> graphviz.Digraph:
    """The lifecycle as a Graphviz digraph: start arrow into the initial state, terminal states double-bordered.

    Each state carries its meaning as a tooltip, and a legend above the picture lists every meaning, so a reader of
    a PNG (which has no tooltips) still learns what the states are.
    """
    name = lifecycle.name
    machine = TransitionsLifecycle(
        lifecycle, default_registry(), machine_cls=_SpecGraphMachine, title=name, graph_engine="graphviz"
    ).machine
    graph = machine.graph_cls(machine)
    graph.set_node_style(lifecycle.initial, "initial")
    for state in lifecycle.terminal:
        graph.set_node_style(state, "terminal")
    dot = graph.get_graph(title=name)
    dot.graph_attr["label"] = _legend(lifecycle)
    for state, meaning in lifecycle.states.items():
        dot.node(state, label=state, tooltip=f"{state}: {meaning}")
    dot.node("__start__", label="", shape="circle", style="filled", fillcolor="black", width="0.2", fixedsize="true")
    dot.edge("__start__", lifecycle.initial)
    return dot


def _legend(lifecycle: Lifecycle) -> str:
    """An HTML-like Graphviz label: the lifecycle's name, then one row per state with its one-line meaning."""
    rows = "".join(
        f'<tr><td align="left" valign="top"><font point-size="12"><b>{html.escape(state)}</b></font></td>'
        f'<td align="left"><font point-size="12">{html.escape(meaning)}</font></td></tr>'
        for state, meaning in lifecycle.states.items()
    )
    terminal = "green, double border: terminal" if lifecycle.terminal else "no terminal state"
    marks = f"blue: initial state · yellow diamond: choice by guards · {terminal}"
    return (
        f'<<table border="0" cellspacing="0" cellpadding="3">'
        f'<tr><td colspan="2" align="left"><font point-size="20"><b>{html.escape(lifecycle.name)}</b></font></td></tr>'
        f'<tr><td colspan="2" align="left"><font point-size="11">{marks}</font></td></tr>'
        f'{rows}</table>>'
    )
