"""Named faults of the shared tier, and Mooncake's status codes mapped onto them.

Mooncake's Python calls answer integers (0 or a byte count on success, a negative `ErrorCode` of its `types.h`
otherwise) instead of raising. The tier turns each negative answer into one of the named faults below, which is
what its log says and what its tests assert: every one of them ends as a miss or a failed fetch that the engine
recomputes, never as bytes loaded.
"""

from __future__ import annotations

from enum import IntEnum


class StoreCode(IntEnum):
    """The Mooncake `ErrorCode` values the tier reacts to (the rest are `StoreRejected`)."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200
    INVALID_PARAMS = -600
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    RPC_FAIL = -900


class TierFault(Exception):
    """A lower-tier operation did not do what was asked; the engine treats the blocks as not there."""


class StoreUnavailable(TierFault):
    """The master cannot be reached (down, restarting, or the client never connected)."""


class StoreTimeout(TierFault):
    """The operation did not finish within its deadline; it may still be running on the I/O thread."""


class StoreBusy(TierFault):
    """Too many operations are queued; refused at once rather than queued behind a slow store."""


class StoreFull(TierFault):
    """The store had no room for the object (and could not evict for it)."""


class KeyMissing(TierFault):
    """The key is not in the store (never stored, evicted, or its lease ran out before the read finished)."""


class ChecksumMismatch(TierFault):
    """The value read has the wrong length, or its checksum or key tag does not match its bytes."""


class StoreRejected(TierFault):
    """Any other negative status from the store."""


_FAULT_OF_CODE: dict[int, type[TierFault]] = {
    StoreCode.NO_AVAILABLE_HANDLE: StoreFull,
    StoreCode.REPLICA_IS_NOT_READY: KeyMissing,
    StoreCode.OBJECT_NOT_FOUND: KeyMissing,
    StoreCode.LEASE_EXPIRED: KeyMissing,
    StoreCode.RPC_FAIL: StoreUnavailable,
}
_SIZE_CODES = frozenset({StoreCode.INVALID_PARAMS, StoreCode.TRANSFER_FAIL})
"""Why these are a checksum fault of a read: Mooncake answers INVALID_PARAMS / TRANSFER_FAIL when the buffers handed
to a read are smaller / larger than the object, i.e. the value is not one the tier wrote for this layout. Of a write
or a removal they say only that the call failed (`StoreRejected`): nothing was read, so nothing is corrupt, and the
tier must not count a forged value or shun the key for it."""


def fault_of(code: int, what: str, read: bool = False) -> TierFault:
    """The named fault for a negative Mooncake status `code` of a read (`read`) or any other call, its message naming
    `what` failed."""
    try:
        name = StoreCode(code).name
    except ValueError:
        name = f"code {code}"
    kind = ChecksumMismatch if read and code in _SIZE_CODES else _FAULT_OF_CODE.get(code, StoreRejected)
    return kind(f"{what}: {name}")
