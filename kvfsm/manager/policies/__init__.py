"""Eviction policies behind one interface (`base`), the built-ins, and the factory that picks one by name or import
path (`factory`)."""

from kvfsm.manager.policies.arc import ArcPolicy
from kvfsm.manager.policies.base import Evictable, EvictionPolicy
from kvfsm.manager.policies.factory import (
    BUILTIN,
    NotAnEvictionPolicy,
    PolicyName,
    UnknownEvictionPolicy,
    make_policy,
    policy_class,
)
from kvfsm.manager.policies.lru import LruPolicy
from kvfsm.manager.policies.s3fifo import S3FifoPolicy
from kvfsm.manager.policies.s3fifo_adaptive import AdaptiveS3FifoPolicy
from kvfsm.manager.policies.tinylfu import TinyLfuPolicy

__all__ = [
    "AdaptiveS3FifoPolicy",
    "BUILTIN",
    "ArcPolicy",
    "Evictable",
    "EvictionPolicy",
    "LruPolicy",
    "NotAnEvictionPolicy",
    "PolicyName",
    "S3FifoPolicy",
    "TinyLfuPolicy",
    "UnknownEvictionPolicy",
    "make_policy",
    "policy_class",
]
