"""The host pool's catalogue (`OffloadingManager`) and the eviction policies behind it."""

from kvfsm.manager.catalogue import (
    BadPoolSize,
    BadSlots,
    DuplicateHashes,
    Lookup,
    ManagerError,
    NotLoadable,
    OffloadingManager,
    PolicyViolation,
    StorePlan,
)
from kvfsm.manager.events import BlockRemoved, BlockStored, KVCacheEvent
from kvfsm.manager import policies
from kvfsm.manager.policies import *  # noqa: F403 (its names, listed once in its own __all__)

__all__ = [
    "BadPoolSize",
    "BadSlots",
    "BlockRemoved",
    "BlockStored",
    "DuplicateHashes",
    "KVCacheEvent",
    "Lookup",
    "ManagerError",
    "NotLoadable",
    "OffloadingManager",
    "PolicyViolation",
    "StorePlan",
] + policies.__all__
