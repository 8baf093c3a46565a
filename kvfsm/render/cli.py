"""`python -m kvfsm.render`: lifecycle diagrams and the `docs/spec.md` reference, drawn from the spec.

The command line: it loads (and so validates) a spec, writes diagrams into a folder, and with `--docs` rewrites
the generated files of a source checkout. Everything it writes is made by the sibling modules. The runtime's
bindings (and with them torch) and the Graphviz drawing are imported once the options are parsed, so `--help` is
quick; an `--out` folder that cannot be written is refused as the options are parsed (`kvfsm.options`).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from kvfsm.options import folder_option
from kvfsm.render.generated import spec_markdown, states_module
from kvfsm.render.mermaid_text import mermaid
from kvfsm.spec import DEFAULT_SPEC_DIR, Spec, SpecError, load_spec

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
STATES_MODULE = Path(__file__).resolve().parents[1] / "states.py"
INSTALL_GRAPHVIZ = (
    "Graphviz's `dot` program is not installed, so no pictures were drawn (the mermaid text was still written). "
    "Install it with `apt-get install graphviz` (Debian/Ubuntu) or `brew install graphviz` (macOS), then rerun."
)


class Format(str, Enum):
    svg = "svg"
    png = "png"
    mermaid = "mermaid"


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
    from kvfsm.render.graphviz_drawing import digraph

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
    out: Path | None = folder_option(None, "--out", help="Folder for one diagram per lifecycle."),
    fmt: Format = typer.Option(Format.svg, "--format", help="Picture format; mermaid text is written in every case."),
    docs: bool = typer.Option(False, "--docs", help="Regenerate docs/spec.md, docs/diagrams/*.svg, kvfsm/states.py."),
) -> None:
    """Draw one diagram per lifecycle of the spec, and/or regenerate the docs."""
    import graphviz

    from kvfsm.bindings import default_registry

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
