"""How the vLLM benches that compare runs row by row print and save their tables: one shape for each of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.console import Console
from rich.table import Table


def cells(row: Mapping[str, Any], columns: Mapping[str, str]) -> list[str]:
    return [f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k]) for k in columns]


def markdown(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> str:
    """The table as docs/benchmarks.md shows it."""
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells(row, columns)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def publish(rows: list[dict[str, Any]], columns: Mapping[str, str], title: str, left: Sequence[str],
            out: Path, stem: str, quick: bool) -> list[dict[str, Any]]:
    """Print the table (the `left` columns' titles aligned left), write `<stem>.json` and `<stem>.md` under `out`;
    the rows."""
    table = Table(title=title)
    for heading in columns.values():
        table.add_column(heading, justify="left" if heading in left else "right")
    for row in rows:
        table.add_row(*cells(row, columns))
    Console(width=200).print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"quick": quick, "rows": rows}, indent=2))
    (out / f"{stem}.md").write_text(markdown(rows, columns))
    return rows
