"""The host pool's catalogue (`OffloadingManager`) and the eviction policies behind it."""

from kvfsm.manager.catalogue import (
    BadPoolSize,
    BadSlots,
    DuplicateHashes,
    Lookup,
    ManagerError,
    NotLoadable,
    OffloadingManager,
    StorePlan,
)
from kvfsm.manager.events import BlockRemoved, BlockStored, KVCacheEvent
from kvfsm.manager.policies import ArcPolicy, EvictionPolicy, LruPolicy, PolicyName, UnknownPolicy, make_policy

__all__ = [
    "ArcPolicy",
    "BadPoolSize",
    "BadSlots",
    "BlockRemoved",
    "BlockStored",
    "DuplicateHashes",
    "EvictionPolicy",
    "KVCacheEvent",
    "Lookup",
    "LruPolicy",
    "ManagerError",
    "NotLoadable",
    "OffloadingManager",
    "PolicyName",
    "StorePlan",
    "UnknownPolicy",
    "make_policy",
]
