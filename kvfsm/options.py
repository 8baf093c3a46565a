"""Option checks the command lines share (`kvfsm.demo`, `kvfsm.render`, `kvfsm.bench`), made while typer parses.

A folder a command will write into is checked before any work runs: otherwise a bad one ends the command in a
traceback after the work (the bench's after 40 s of measuring). click's `writable` checks a folder that exists;
one that does not is made by the command, so its nearest existing ancestor must be a folder we may write in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer


def creatable_folder(path: Path | None) -> Path | None:
    """A typer callback: `path` unchanged, or `typer.BadParameter` (exit 2, naming the option) when it cannot be
    made. Nothing is created here: the command makes the folder when it first writes."""
    if path is None or path.exists():
        return path  # click's own `file_okay=False, writable=True` judged it
    ancestor = next(parent for parent in path.absolute().parents if parent.exists())
    if not ancestor.is_dir():
        raise typer.BadParameter(f"{path} cannot be made: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"{path} cannot be made: {ancestor} is not writable")
    return path


def folder_option(default: Path | None, *names: str, help: str, show_default: bool = True) -> Any:
    """A typer option naming a folder the command writes into, refused at parse time if it cannot be written."""
    return typer.Option(default, *names, help=help, show_default=show_default, file_okay=False, writable=True,
                        callback=creatable_folder)
