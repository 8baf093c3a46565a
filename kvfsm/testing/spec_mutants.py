"""Mutants of the spec itself: one transition of one lifecycle with a guard, an effect or a coupling dropped, or its
destination retargeted.

The spec is the truth, so a wrong spec is the one bug no comparison with the spec can see: the machines would run
the wrong lifecycle faithfully. What must catch it is the loader's checks or what a running engine shows (a refused
trigger, a broken invariant, wrong bytes, a wrong token, a leak). `tests/test_spec_mutants.py` requires that every
mutant made here is caught by one of them, or is listed with the reason it cannot be.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from kvfsm.bindings import default_registry
from kvfsm.spec import DEFAULT_SPEC_DIR, Spec, load_spec
from kvfsm.testing import harness

Document = dict[str, Any]


@dataclass(frozen=True)
class SpecMutant:
    name: str
    """e.g. `request #9 (preempt running -> preempted): drop coupling transfer-job.flush(flushable-stores)`."""
    documents: dict[str, Document]
    """Every lifecycle file of the spec by file name, one of them mutated."""

    def write(self, directory: Path) -> Path:
        for file, document in self.documents.items():
            (directory / file).write_text(yaml.safe_dump(document, sort_keys=False))
        return directory


def _sources(transition: Document) -> list[str]:
    source = transition["source"]
    return [source] if isinstance(source, str) else list(source)


def _retarget(document: Document, transition: Document) -> str:
    """The state a retargeted transition goes to instead: where it came from (a transition that does nothing) or,
    when it already stays put, the next declared state."""
    states = list(document["states"])
    first = _sources(transition)[0]
    if first != transition["dest"]:
        return first
    return states[(states.index(first) + 1) % len(states)]


def _coupling(coupling: Document) -> str:
    return f"{coupling['target']}.{coupling['fire']}({coupling['of']})"


def _edits(document: Document, transition: Document) -> list[tuple[str, str, Any]]:
    """(what, key, new value) for every single edit of one transition."""
    def without(key: str, item: object) -> list[object]:
        return [x for x in transition[key] if x != item]

    return [
        *((f"drop guard {g}", "guards", without("guards", g)) for g in transition.get("guards", [])),
        *((f"drop effect {e}", "effects", without("effects", e)) for e in transition.get("effects", [])),
        *((f"drop coupling {_coupling(c)}", "couplings", without("couplings", c))
          for c in transition.get("couplings", [])),
        (f"retarget to {_retarget(document, transition)}", "dest", _retarget(document, transition)),
    ]


def shipped(directory: Path = DEFAULT_SPEC_DIR) -> SpecMutant:
    """The lifecycles in `directory` unchanged: the baseline every mutant is compared against."""
    return SpecMutant("shipped", {path.name: yaml.safe_load(path.read_text())
                                  for path in sorted(directory.glob("*.yaml"))})


def spec_mutants(directory: Path = DEFAULT_SPEC_DIR) -> list[SpecMutant]:
    """Every single-edit mutant of the lifecycles in `directory`."""
    originals = shipped(directory).documents
    found = []
    for file, document in originals.items():
        for index, transition in enumerate(document["transitions"]):
            edge = (f"{document['lifecycle']} #{index + 1} ({transition['trigger']} "
                    f"{','.join(_sources(transition))} -> {transition['dest']})")
            for what, key, value in _edits(document, transition):
                documents = copy.deepcopy(originals)
                documents[file]["transitions"][index][key] = value
                found.append(SpecMutant(f"{edge}: {what}", documents))
    return found


def load_mutant(mutant: SpecMutant, directory: Path) -> Spec:
    """The mutant's spec as the loader sees it (raises `SpecError` where the loader's checks catch it)."""
    return load_spec(mutant.write(directory), registry=default_registry())


@contextmanager
def running(spec: Spec) -> Iterator[None]:
    """Every `Harness` built inside (the scenarios', the interleavings') gives its connector machines built from
    `spec` instead of the shipped lifecycles: the product code stays as shipped, only its truth changes."""
    original = harness.default_spec
    harness.default_spec = lambda: spec  # type: ignore[assignment]
    try:
        yield
    finally:
        harness.default_spec = original  # type: ignore[assignment]
