"""Every bookkeeping structure a connector keeps, measured by walking its objects: what a soak checks for growth.

A check that lists the structures it measures misses the next one someone adds, so the census finds them: from the
roots it is given it follows every attribute of every object of a kvfsm product module (records, the ledger, the
planner, the manager, the tiers, their entries and jobs, the Mooncake client...) and, for each class and
attribute, sums the length of every container it finds there (nested containers are counted under `name[]`, a
queue by its `qsize`), and counts the instances of each class. An object that names itself (a tier's `name`, a
record's `tier`) is counted under that name too, so that a disk's entries and a shared store's are told apart.

Not walked: objects of the harness and the reference engine (`kvfsm.testing`, `kvfsm.engine`, `kvfsm.checking`,
the simulated device), which keep logs and traces on purpose; and anything outside kvfsm, except a container or a
queue held by a kvfsm object. The walk follows references, so a structure is measured wherever it is reachable
from, not where it was made.
"""

from __future__ import annotations

from collections import Counter, deque
from enum import Enum
from typing import Any, Iterable, Iterator

NOT_PRODUCT = ("kvfsm.testing", "kvfsm.engine", "kvfsm.checking", "kvfsm.executor.sim", "kvfsm.demo", "kvfsm.bench")
"""Modules whose objects are the soak's own instruments or the engine under it, not the connector's bookkeeping."""

CONTAINERS = (dict, list, tuple, set, frozenset, deque)


def _is_product(obj: object) -> bool:
    module = type(obj).__module__
    return module.startswith("kvfsm.") and not module.startswith(NOT_PRODUCT) and not isinstance(obj, Enum)


def _fields(obj: object) -> Iterator[tuple[str, Any]]:
    """Every attribute an instance holds: its `__dict__` and its slots (a slots dataclass has no `__dict__`)."""
    yield from getattr(obj, "__dict__", {}).items()
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                yield name, getattr(obj, name)


def _label(obj: object) -> str:
    """The class's name, with the name the object gives itself (`TierEntries[mooncake]`)."""
    own = getattr(obj, "name", None) or getattr(obj, "tier", None)
    return f"{type(obj).__name__}[{own}]" if isinstance(own, str) and own else type(obj).__name__


def _elements(container: Any) -> Iterable[object]:
    return (*container.keys(), *container.values()) if isinstance(container, dict) else container


def census(*roots: object) -> Counter[str]:
    """The size of every structure reachable from `roots`, by `Class.attribute` (summed over instances), and the
    number of instances of each class."""
    sizes: Counter[str] = Counter()
    seen: set[int] = set()
    objects: list[object] = [root for root in roots if _is_product(root)]

    def measure(path: str, value: object) -> None:
        """Count a container at `path` and what it holds; queue the kvfsm objects found in it."""
        if id(value) in seen:
            return
        if isinstance(value, CONTAINERS):
            seen.add(id(value))
            sizes[path] += len(value)
            for element in _elements(value):
                if isinstance(element, CONTAINERS):
                    measure(f"{path}[]", element)
                elif _is_product(element):
                    objects.append(element)
        elif _is_product(value):
            objects.append(value)
        elif callable(getattr(value, "qsize", None)):
            seen.add(id(value))
            sizes[path] += value.qsize()  # type: ignore[attr-defined]

    while objects:
        obj = objects.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        label = _label(obj)
        sizes[label] += 1
        for name, value in _fields(obj):
            measure(f"{label}.{name}", value)
    return sizes


def over(sizes: Counter[str], bound: int) -> dict[str, int]:
    """The structures of a census larger than `bound`."""
    return {name: size for name, size in sorted(sizes.items()) if size > bound}
