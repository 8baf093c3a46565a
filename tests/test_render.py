"""`python -m kvfsm.render`: the docs and diagrams say what the spec says, and the command fails loudly only on a bad spec."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
import yaml
from typer.testing import CliRunner

from kvfsm.bindings import default_registry, default_spec
from kvfsm.render import (
    DOCS_COMMAND, DOCS_DIR, STATES_MODULE, app, couplings_mermaid, digraph, mermaid, spec_markdown, states_module,
    transition_label,
)
from kvfsm.render.generated import _camel, _constant
from kvfsm.spec import DEFAULT_SPEC_DIR, Lifecycle, SpecError, load_spec

SPEC = default_spec()
LIFECYCLES = list(SPEC.lifecycles.values())
runner = CliRunner()


def _ids(lifecycles: list[Lifecycle]) -> list[str]:
    return [lc.name for lc in lifecycles]


def test_committed_spec_md_is_what_the_generator_makes_from_spec_now() -> None:
    committed = (DOCS_DIR / "spec.md").read_text()
    assert committed == spec_markdown(SPEC, DEFAULT_SPEC_DIR), f"docs/spec.md is stale: run `{DOCS_COMMAND}`"


def test_spec_md_names_every_lifecycle_state_trigger_and_invariant() -> None:
    doc = spec_markdown(SPEC, DEFAULT_SPEC_DIR)
    for lc in LIFECYCLES:
        assert f"## {lc.name}" in doc
        for name in (*lc.states, *lc.triggers, *lc.invariants):
            assert f"`{name}`" in doc, name


def _mermaid_edges(text: str) -> dict[tuple[str, str], str]:
    return {(m[1], m[2]): m[3] for m in re.finditer(r"^\s*(\S+) --> (\S+): (.*)$", text, re.MULTILINE)}


@pytest.mark.parametrize("lifecycle", LIFECYCLES, ids=_ids(LIFECYCLES))
def test_mermaid_names_every_transition(lifecycle: Lifecycle) -> None:
    """Each (source, trigger) is an arrow to its dest, or an arrow into a choice whose arrow to dest has its guards."""
    text = mermaid(lifecycle)
    assert text.startswith("stateDiagram-v2\n")
    edges = _mermaid_edges(text)
    node = {state: node for state in lifecycle.states for node in [re.sub(r"\W", "_", state)]}
    for t in lifecycle.transitions:
        effects = t.effects + tuple(str(c) for c in t.couplings)  # a coupling is drawn as an effect
        for source in t.source:
            direct = edges.get((node[source], node[t.dest]), "")
            via_choice = any(
                src == node[source] and t.trigger in label.split(" | ")
                and transition_label("", t.guards, effects) in edges.get((choice, node[t.dest]), "").split(" | ")
                for (src, choice), label in edges.items()
                if choice.startswith("choice_")
            )
            assert transition_label(t.trigger, t.guards, effects) in direct.split(" | ") or via_choice, (
                f"{lifecycle.name}: {source} --{t.trigger}--> {t.dest} is not drawn"
            )


def test_render_of_a_broken_spec_exits_nonzero_with_the_loader_message(tmp_path: Path) -> None:
    spec_dir = tmp_path / "spec"
    shutil.copytree(DEFAULT_SPEC_DIR, spec_dir)
    path = spec_dir / "request.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["transitions"][0]["dest"] = "nowhere"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(SpecError) as caught:
        load_spec(spec_dir, registry=default_registry())
    run = subprocess.run(
        [sys.executable, "-m", "kvfsm.render", "--spec", str(spec_dir), "--out", str(tmp_path / "out")],
        capture_output=True, text=True,
    )
    assert run.returncode != 0
    assert str(caught.value) in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()


def test_render_of_a_spec_naming_an_unbound_guard_exits_nonzero(tmp_path: Path) -> None:
    """The loader is handed a registry rather than importing one; render hands it kvfsm's, so typos still fail."""
    spec_dir = tmp_path / "spec"
    shutil.copytree(DEFAULT_SPEC_DIR, spec_dir)
    path = spec_dir / "transfer-job.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["transitions"][0]["guards"] = ["is-stor"]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = runner.invoke(app, ["--spec", str(spec_dir), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "guard 'is-stor' is not defined in the guard registry" in result.output
    assert not (tmp_path / "out").exists()


def test_without_graphviz_it_writes_mermaid_says_how_to_install_and_exits_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    result = runner.invoke(app, ["--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "apt-get install graphviz" in result.output and "brew install graphviz" in result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{lc.name}.mmd" for lc in LIFECYCLES)


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot binary")
def test_with_graphviz_it_writes_one_svg_per_lifecycle(tmp_path: Path) -> None:
    result = runner.invoke(app, ["--out", str(tmp_path), "--format", "svg"])
    assert result.exit_code == 0, result.output
    for lc in LIFECYCLES:
        svg = ElementTree.parse(tmp_path / f"{lc.name}.svg").getroot()
        titles = {title.text for title in svg.iter("{http://www.w3.org/2000/svg}title")}
        assert set(lc.states) <= titles, f"{lc.name}: states missing from the picture"


def test_committed_states_module_is_what_the_generator_makes_from_spec_now() -> None:
    assert STATES_MODULE.read_text() == states_module(SPEC), f"kvfsm/states.py is stale: run `{DOCS_COMMAND}`"


def test_states_module_names_every_state_of_every_lifecycle() -> None:
    namespace: dict[str, object] = {}
    exec(states_module(SPEC), namespace)  # noqa: S102  (the generator's own output)
    for lc in LIFECYCLES:
        names = namespace[_camel(lc.name) + "State"]
        assert {getattr(names, _constant(s)) for s in lc.states} == set(lc.states)


def test_couplings_are_drawn_from_every_transition_that_declares_one() -> None:
    drawn = couplings_mermaid(SPEC)
    for lc in LIFECYCLES:
        for t in lc.transitions:
            for c in t.couplings:
                assert f"→ {c.fire} ({c.relation})\" --> {c.lifecycle.replace('-', '_')}" in drawn


@pytest.mark.parametrize("lifecycle", LIFECYCLES, ids=_ids(LIFECYCLES))
def test_the_graphviz_diagram_names_every_guard_and_effect_on_its_edges(lifecycle: Lifecycle) -> None:
    edges = [line for line in digraph(lifecycle).source.splitlines() if "->" in line]
    labels = " ".join(edges)
    for t in lifecycle.transitions:
        for name in (*t.guards, *t.effects):
            assert name in labels, f"{lifecycle.name}: {name} is on no edge"
    assert "None" not in labels


@pytest.mark.parametrize("lifecycle", LIFECYCLES, ids=_ids(LIFECYCLES))
def test_the_graphviz_diagram_draws_no_state_the_spec_lacks(lifecycle: Lifecycle) -> None:
    drawn = {m.group(1) for line in digraph(lifecycle).source.splitlines() if "->" not in line
             if (m := re.match(r'\t"?([^"\s\[]+)"? \[', line))} - {"graph", "node", "edge", "__start__"}
    assert {name for name in drawn if not name.startswith("choice-")} == set(lifecycle.states)
