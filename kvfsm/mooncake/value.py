"""The stored value of one block: the slot's bytes, then a 32-byte trailer that lets a reader refuse bad bytes.

The store itself guarantees that a get sees only a completely written object, but not that the object under a key
is the one this tier wrote for it: another writer, a bug, a bad DIMM on the segment host or a foreign format can put
other bytes there. The trailer binds the value to its key and its bytes: a BLAKE2b tag of the key, the payload
length and a CRC-32 of the payload. A reader checks all three before the slot may become loadable; any mismatch is
`ChecksumMismatch`, a failed fetch. The trailer travels in the same object (one multi-buffer put), so a value and
its trailer can never come from two different writes.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np

from kvfsm.mooncake.errors import ChecksumMismatch

TRAILER = struct.Struct("<20sIQ")
TRAILER_BYTES = TRAILER.size


def key_tag(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=20).digest()


def seal(trailer: np.ndarray, key: str, payload: np.ndarray) -> int:
    """Fill `trailer` (TRAILER_BYTES uint8) for `payload` stored under `key`; returns the payload's CRC-32."""
    crc = zlib.crc32(payload)
    trailer[:] = np.frombuffer(TRAILER.pack(key_tag(key), crc, payload.nbytes), dtype=np.uint8)
    return crc


def check(trailer: np.ndarray, key: str, payload: np.ndarray) -> int:
    """The payload's CRC-32 if `trailer` was sealed for exactly these `payload` bytes under `key`, else raise
    `ChecksumMismatch`."""
    tag, crc, length = TRAILER.unpack(trailer.tobytes())
    if tag != key_tag(key):
        raise ChecksumMismatch(f"{key}: the value was written for another key")
    if length != payload.nbytes:
        raise ChecksumMismatch(f"{key}: the value holds {length} bytes, the slot {payload.nbytes}")
    if crc != zlib.crc32(payload):
        raise ChecksumMismatch(f"{key}: CRC-32 of the value does not match its trailer")
    return int(crc)
