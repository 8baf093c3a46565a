"""From `OffloadConfig.eviction` to a policy: a built-in's name, or `package.module:ClassName` for a user's own.

Resolving is separate from building so that the connector can refuse a bad name at start-up, before a byte is
pinned, and the manager builds the policy once it knows the pool's size.
"""

from __future__ import annotations

import importlib
import inspect
from kvfsm.config import EvictionName as PolicyName
from kvfsm.manager.policies.arc import ArcPolicy
from kvfsm.manager.policies.base import EvictionPolicy
from kvfsm.manager.policies.lru import LruPolicy
from kvfsm.manager.policies.s3fifo import S3FifoPolicy
from kvfsm.manager.policies.s3fifo_adaptive import AdaptiveS3FifoPolicy
from kvfsm.manager.policies.tinylfu import TinyLfuPolicy

BUILTIN: dict[str, type[EvictionPolicy]] = {
    "lru": LruPolicy, "arc": ArcPolicy, "s3-fifo": S3FifoPolicy, "s3-fifo-adaptive": AdaptiveS3FifoPolicy,
    "tinylfu": TinyLfuPolicy, "w-tinylfu": TinyLfuPolicy,
}
"""Every built-in by name (`tinylfu` and `w-tinylfu` are one policy: TinyLFU with its window)."""


class UnknownEvictionPolicy(ValueError):
    """`eviction` names no built-in, or an import path whose module or class cannot be imported."""


class NotAnEvictionPolicy(TypeError):
    """`eviction`'s import path names something that is not a concrete `EvictionPolicy` subclass."""


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class `name` selects; raises `UnknownEvictionPolicy` or `NotAnEvictionPolicy`, having built nothing."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, colon, attribute = name.partition(":")
    if not colon:
        raise UnknownEvictionPolicy(f"unknown eviction policy {name!r}; legal: one of {sorted(BUILTIN)} "
                                    "or an import path package.module:ClassName")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as missing:
        raise UnknownEvictionPolicy(f"eviction policy {name!r} cannot be imported: {missing}") from missing
    if not (inspect.isclass(found) and issubclass(found, EvictionPolicy)):
        raise NotAnEvictionPolicy(f"eviction policy {name!r} is {found!r}; legal: a subclass of "
                                  "kvfsm.manager.EvictionPolicy")
    if inspect.isabstract(found):
        missing_methods = sorted(found.__abstractmethods__)
        raise NotAnEvictionPolicy(f"eviction policy {name!r} does not implement {', '.join(missing_methods)}")
    return found


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A policy for a pool of `capacity` slots, by name or import path."""
    return policy_class(name)(capacity)
