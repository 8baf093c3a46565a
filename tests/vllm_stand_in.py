"""A stand-in for the `vllm` package where it is not installed (the GPU machine), so the adapter imports.

Only the adapter's worker half runs against it: every `vllm.*` module and every name in it is an empty class (any
attribute of which is another), enough for the adapter's class statements and imports, and nothing else. Where vLLM
is installed `install()` does nothing and the real package is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


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


def install() -> bool:
    """Stand in for vLLM unless it is installed; whether the stand-in is now in place."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return True
    if importlib.util.find_spec("vllm") is not None:
        return False
    sys.meta_path.append(_Finder())
    return True
