"""`python -m kvfsm.render`: lifecycle diagrams and the `docs/spec.md` reference, drawn from the spec.

Nothing here names a state or a trigger: every picture and every table is derived from a loaded `Spec`, so a
diagram cannot drift from the machines the runtime builds. Graphviz pictures go through transitions' own diagram
support (a `GraphMachine` built by `TransitionsLifecycle`), so they show what the library thinks the spec means.
Mermaid text is produced from the spec directly: it needs no binary, so it is always written (CI machines have no
`dot`), and GitHub renders it inline in `docs/spec.md`.
"""

from __future__ import annotations

import html
import re
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import graphviz
import typer
from transitions.extensions.diagrams import GraphMachine
from transitions.extensions.diagrams_graphviz import Graph

from kvfsm.machines import TransitionsLifecycle
from kvfsm.bindings import default_registry
from kvfsm.spec import DEFAULT_SPEC_DIR, Lifecycle, Spec, SpecError, load_spec

DOCS_DIR = Path(__file__).resolve().parent.parent / "docs"
STATES_MODULE = Path(__file__).resolve().parent / "states.py"
DOCS_COMMAND = "python -m kvfsm.render --docs"
INSTALL_GRAPHVIZ = (
    "Graphviz's `dot` program is not installed, so no pictures were drawn (the mermaid text was still written). "
    "Install it with `apt-get install graphviz` (Debian/Ubuntu) or `brew install graphviz` (macOS), then rerun."
)


class Format(str, Enum):
    svg = "svg"
    png = "png"
    mermaid = "mermaid"


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


# --- Graphviz, through transitions' diagram support -----------------------------------------------------------

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


# --- Mermaid, straight from the spec -------------------------------------------------------------------------------


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


def states_module(spec: Spec) -> str:
    """`kvfsm/states.py`: one class of state-name constants per lifecycle, so code never spells a state by hand."""
    out = [
        '"""State names of every lifecycle, generated from the spec: code compares against these, never literals.',
        "",
        f"Generated by `{DOCS_COMMAND}`; do not edit by hand (`tests/test_render.py` checks it is current).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Final",
    ]
    for name, lc in spec.lifecycles.items():
        out += ["", "", f"class {_camel(name)}State:", f'    """The states of `{name}`."""', ""]
        out += [f'    {_constant(state)}: Final = "{state}"' for state in lc.states]
    return "\n".join(out) + "\n"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"\W", name))


def _constant(state: str) -> str:
    return re.sub(r"\W", "_", state).upper()


# --- docs/spec.md --------------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _names(names: Sequence[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "—"


def _shown(spec_dir: Path) -> str:
    """A spec folder as the docs name it: its last two parts (`kvfsm/lifecycles`), the same on every machine."""
    return f"{spec_dir.parent.name}/{spec_dir.name}"


def spec_markdown(spec: Spec, spec_dir: Path) -> str:
    """The reference of every lifecycle; a pure function of the spec, so the committed copy can be checked."""
    out = [
        "# Lifecycle reference",
        "",
        f"<!-- Generated from `{_shown(spec_dir)}/*.yaml` by `{DOCS_COMMAND}`; do not edit by hand. -->",
        "",
        "Each lifecycle below is declared in one YAML file; the machines, these tables and the pictures are all "
        "derived from it. A transition reads `trigger [guards] / effects`: it fires only when every guard holds, "
        "and runs its effects after the state changes. Where several transitions share a (state, trigger), their "
        "guards are tried in the order listed.",
        "",
    ]
    out += [f"- [{name}](#{name}): {lc.description}" for name, lc in spec.lifecycles.items()]
    out += [
        "",
        "## Couplings",
        "",
        "A transition may fire triggers on other lifecycles' objects (`couplings:` in the YAML, drawn as effects "
        "named `lifecycle.trigger(relation)`): each arrow below goes from the transition to the lifecycle it moves, "
        "labelled with the trigger it fires there and the relation that names the objects.",
        "",
        "```mermaid",
        couplings_mermaid(spec).rstrip("\n"),
        "```",
    ]
    for name, lc in spec.lifecycles.items():
        out += [
            "",
            f"## {name}",
            "",
            lc.description,
            "",
            f"Declared in `{_shown(spec_dir)}/{Path(spec.files[name]).name}`. "
            f"Picture: [`diagrams/{name}.svg`](diagrams/{name}.svg).",
            "",
            "```mermaid",
            mermaid(lc).rstrip("\n"),
            "```",
            "",
            "### States",
            "",
            "| state | role | meaning |",
            "| --- | --- | --- |",
        ]
        for state, meaning in lc.states.items():
            role = "initial" if state == lc.initial else "terminal" if state in lc.terminal else ""
            out.append(f"| `{state}` | {role} | {_cell(meaning)} |")
        out += [
            "",
            "### Transitions",
            "",
            "| trigger | from | to | guards | effects | couplings |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        out += [
            f"| `{t.trigger}` | {_names(t.source)} | `{t.dest}` | {_names(t.guards)} | {_names(t.effects)} "
            f"| {_names([str(c) for c in t.couplings])} |"
            for t in lc.transitions
        ]
        out += ["", "### Invariants", ""]
        out += [f"- **`{inv}`**: {_cell(sentence)}" for inv, sentence in lc.invariants.items()] or ["None."]
    return "\n".join(out) + "\n"


# --- command line --------------------------------------------------------------------------------------------------


def write_mermaid(spec: Spec, out: Path) -> list[Path]:
    """One `<lifecycle>.mmd` per lifecycle in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, lc in spec.lifecycles.items():
        path = out / f"{name}.mmd"
        path.write_text(mermaid(lc))
        paths.append(path)
    return paths


def write_pictures(spec: Spec, out: Path, fmt: str) -> list[Path]:
    """One `<lifecycle>.<fmt>` per lifecycle in `out`; raises `graphviz.ExecutableNotFound` without `dot`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, lc in spec.lifecycles.items():
        path = out / f"{name}.{fmt}"
        path.write_bytes(digraph(lc).pipe(format=fmt))
        paths.append(path)
    return paths


app = typer.Typer(add_completion=False, help=__doc__.split("\n")[0])


@app.command()
def main(
    spec_dir: Path = typer.Option(DEFAULT_SPEC_DIR, "--spec", exists=True, file_okay=False,
                                  help="Spec folder to load (and so validate)."),
    out: Path | None = typer.Option(None, "--out", file_okay=False, help="Folder for one diagram per lifecycle."),
    fmt: Format = typer.Option(Format.svg, "--format", help="Picture format; mermaid text is written in every case."),
    docs: bool = typer.Option(False, "--docs", help="Regenerate docs/spec.md, docs/diagrams/*.svg, kvfsm/states.py."),
) -> None:
    """Draw one diagram per lifecycle of the spec, and/or regenerate the docs."""
    if out is None and not docs:
        raise typer.BadParameter("name a folder with --out DIR, or pass --docs to regenerate docs/", param_hint="--out")
    if docs and not (DOCS_DIR / "spec.md").is_file():
        raise typer.BadParameter(f"--docs regenerates a source checkout's docs/, and {DOCS_DIR} is not one; "
                                 "use --out DIR", param_hint="--docs")
    try:
        spec = load_spec(spec_dir, registry=default_registry())
    except SpecError as err:
        typer.echo(f"spec error: {err}", err=True)
        raise typer.Exit(code=1) from None
    jobs: list[tuple[Path, str]] = []
    if out is not None:
        written = write_mermaid(spec, out)
        if fmt is not Format.mermaid:
            jobs.append((out, fmt.value))
    else:
        written = []
    if docs:
        spec_md = DOCS_DIR / "spec.md"
        spec_md.parent.mkdir(parents=True, exist_ok=True)
        spec_md.write_text(spec_markdown(spec, spec_dir))
        written.append(spec_md)
        STATES_MODULE.write_text(states_module(spec))
        written.append(STATES_MODULE)
        jobs.append((DOCS_DIR / "diagrams", "svg"))
    try:
        for folder, picture_format in jobs:
            written += write_pictures(spec, folder, picture_format)
    except graphviz.ExecutableNotFound:
        typer.echo(INSTALL_GRAPHVIZ, err=True)
    for path in written:
        typer.echo(f"wrote {path}")


if __name__ == "__main__":
    app()
