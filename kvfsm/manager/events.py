"""KV-cache events the manager emits, for engines that publish which prefixes the host pool can serve.

A hash is announced stored when its block becomes readable and removed when it stops being catalogued while
readable (eviction, reset); replaying the stream in order therefore yields exactly the catalogued readable hashes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """These hashes became loadable from the host pool."""

    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These hashes are no longer loadable from the host pool."""

    hashes: tuple[int, ...]


KVCacheEvent = BlockStored | BlockRemoved
