"""A stand-in for the `vllm` package where it is not installed (the GPU machines), so the adapter imports.

Only the adapter's worker half runs against it (`python -m kvfsm.bench vllm-layers` and its GPU test drive it in
vLLM's hook order on a real GPU, where vLLM is not installed): every `vllm.*` module and every name in it is an
empty class (any attribute of which is another), enough for the adapter's class statements and imports, and nothing
else. Where vLLM is installed `standing_in()` does nothing and the real package is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from contextlib import contextmanager
from typing import Iterator


class _Anything(type):
    """A class whose every missing attribute is another such class (an enum member, a base class, a constant)."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Anything(name, (), {})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []  # a package: its submodules are stood in for too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


STOOD_IN = ("vllm", "kvfsm.integrations.vllm")
"""The packages whose modules, imported against the stand-in, are forgotten when it is taken away."""


@contextmanager
def standing_in() -> Iterator[bool]:
    """Stand in for vLLM inside the block unless it is installed (yields whether the stand-in is in place).

    On leaving, the stand-in and every module imported against it are forgotten, so a later `import vllm` (a
    test's `importorskip`) in the same process finds no vLLM rather than the stand-in."""
    if importlib.util.find_spec("vllm") is not None:
        yield False
        return
    finder = _Finder()
    sys.meta_path.append(finder)
    try:
        yield True
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if any(n == p or n.startswith(p + ".") for p in STOOD_IN)]:
            del sys.modules[name]
        integrations = sys.modules.get("kvfsm.integrations")
        if integrations is not None and hasattr(integrations, "vllm"):
            delattr(integrations, "vllm")
