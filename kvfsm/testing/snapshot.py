"""A comparable picture of everything an object holds, to check that a refused call changed nothing.

The picture walks the object's fields (`__dict__` and `__slots__`), containers in their order (an LRU's order is
state), tensors by their bytes, and shared objects once, so two pictures are equal exactly when nothing reachable
changed. It reads fields generically rather than naming them, so it keeps working while the connector's internals
change shape; callables are named, not entered (a queued closure is the device's, not state the call could touch).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import types
from collections import deque
from collections.abc import Mapping
from typing import Any, Hashable

import torch

MAX_TENSOR_BYTES = 1 << 22
"""Tensors up to this size are compared by content; larger ones by identity and shape (tests keep theirs small)."""

_ATOMS = (type(None), bool, int, float, complex, str, bytes, enum.Enum)
_CODE = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


def snapshot(root: object) -> Hashable:
    """Everything reachable from `root`, as nested tuples."""
    seen: dict[int, int] = {}
    keep_alive: list[object] = []  # ids stay unique while the walk runs

    def fields(obj: object) -> list[tuple[str, Any]]:
        names: list[str] = []
        for cls in type(obj).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            names.extend([slots] if isinstance(slots, str) else slots)
        found = [(n, getattr(obj, n)) for n in names if n not in ("__dict__", "__weakref__") and hasattr(obj, n)]
        return found + sorted(getattr(obj, "__dict__", {}).items())

    def walk(obj: object) -> Hashable:
        if isinstance(obj, _ATOMS):
            return obj  # type: ignore[return-value]
        if isinstance(obj, torch.Tensor):
            return _tensor(obj)
        if isinstance(obj, _CODE):
            return ("callable", getattr(obj, "__qualname__", repr(obj)))
        if id(obj) in seen:
            return ("seen", seen[id(obj)])
        seen[id(obj)] = len(seen)
        keep_alive.append(obj)
        if isinstance(obj, (list, tuple, deque)):
            return (type(obj).__name__, tuple(walk(x) for x in obj))
        if isinstance(obj, (set, frozenset)):
            return (type(obj).__name__, frozenset(walk(x) for x in obj))
        if isinstance(obj, Mapping):
            return (type(obj).__name__, tuple((walk(k), walk(v)) for k, v in obj.items()))
        return (type(obj).__qualname__, tuple((name, walk(value)) for name, value in fields(obj)))

    return walk(root)


def _tensor(tensor: torch.Tensor) -> Hashable:
    shape = (str(tensor.dtype), tuple(tensor.shape), str(tensor.device))
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes > MAX_TENSOR_BYTES:
        return ("tensor", *shape, tensor.data_ptr())
    raw = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
    return ("tensor", *shape, hashlib.blake2b(raw, digest_size=16).hexdigest())
