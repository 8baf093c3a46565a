"""Package names imported on first use (PEP 562), so that a command line's `--help` does not wait for torch.

`python -m kvfsm.demo` (or `render`, `bench`) imports `kvfsm` and the command's package before its `__main__`;
a package `__init__` that re-exported its heavy modules' names eagerly made `--help` take seconds (16 s on a busy
machine) importing torch it never used. A package lists where each name lives instead, and `attributes` imports a
name's module only when the name is first read.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any, Callable, Mapping, Sequence


def exported(homes: Mapping[str, Sequence[str]]) -> list[str]:
    """Every name a package's `homes` ({submodule: names}) exports: its `__all__`."""
    return sorted(name for names in homes.values() for name in names)


def attributes(package: str, homes: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: a name of `homes[module]` is read from `package.module`, imported on
    first use and then kept on the package, so later reads are plain attribute reads."""
    home_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{home_of[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
