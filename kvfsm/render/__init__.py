"""`python -m kvfsm.render`: lifecycle diagrams and the `docs/spec.md` reference, drawn from the spec.

Nothing here names a state or a trigger: every picture and every table is derived from a loaded `Spec`, so a
diagram cannot drift from the machines the runtime builds. Graphviz pictures go through transitions' own diagram
support (a `GraphMachine` built by `TransitionsLifecycle`), so they show what the library thinks the spec means.
Mermaid text is produced from the spec directly: it needs no binary, so it is always written (CI machines have no
`dot`), and GitHub renders it inline in `docs/spec.md`.

One concern per module, imported one way: `diagram_model` holds the arrows both drawings share, `graphviz_drawing`
and `mermaid_text` draw them, `generated` makes `docs/spec.md` (with the Mermaid text) and `kvfsm/states.py`, and
`cli` is the command over all of them (`__main__` runs it). Their public names are importable from here, each
imported on first use (`lazy_loader`), so `--help` never imports the runtime's bindings and torch.
"""

import lazy_loader

_HOMES = {
    "cli": ("DOCS_DIR", "INSTALL_GRAPHVIZ", "STATES_MODULE", "Format", "app", "main", "write_mermaid",
            "write_pictures"),
    "diagram_model": ("Branch", "Choice", "Diagram", "Edge", "branches", "diagram", "transition_label"),
    "generated": ("DOCS_COMMAND", "spec_markdown", "states_module"),
    "graphviz_drawing": ("digraph",),
    "mermaid_text": ("couplings_mermaid", "mermaid"),
}
__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs=_HOMES)

