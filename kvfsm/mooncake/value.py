"""The stored value of one block: the slot's bytes, and a 48-byte trailer that lets a reader refuse any value its
tenant did not write.

The store guarantees that a get sees only a completely written object, not that the object under a key is one this
tenant wrote for it: every client of the master may put any bytes under any key it can name, and keys are derived
from configuration anyone can guess (`kvfsm.mooncake.keys`). So the trailer holds a MAC: keyed BLAKE3 (the `blake3`
package, under the tenant's 32-byte `ValueKey`) over a header (format, the block's own checksum when the engine
carries one, the payload's length, the key's length), the key and every payload byte. A reader recomputes it before
the slot may become loadable; a value whose MAC does not verify (another writer's, a corrupted one, a value of an
older format) is `ChecksumMismatch`, a failed fetch. The MAC subsumes the former CRC-32 trailer: a keyed MAC detects
accidental corruption as well as forgery.

Why keyed BLAKE3: every byte of every value is MACed on the path of a transfer, on the client's MAC threads, and
`blake3` releases the GIL while it hashes, so those threads run on as many cores as there are threads and never
hold up the I/O thread or the engine's own Python between two store calls. (AES-GMAC from `cryptography`, which
kvfsm used in between, hashes faster per core, but whether it releases the GIL depends on the build: on CPython 3.11
with `cryptography` 50 two threads sealed no faster than one, while on the GPU host's 3.12 eight did scale:
docs/mooncake.md.) Keyed BLAKE3 is a PRF, so its tag
is a MAC with no nonce to manage: the same bytes under the same key seal to the same trailer.

The block's own checksum (`OffloadConfig.checksum`: the CRC-32 the CPU pool took when the block was first stored)
travels in the trailer, under the MAC, so a fetch hands it back and the load that follows is checked against the
bytes as first stored, not as found in the store.

A value is two objects: the payload under its key and the trailer under `trailer_key(key)`. The writer puts the
payload first, while its MAC threads seal, and the trailer once both are done, so the payload's put never waits for
a seal, and the trailer's presence publishes the value: a reader asks for both. A payload and a trailer from two
different writes of one key verify together only if the payloads were the same bytes; any other pair is a failed
check, a miss, never wrong KV. What the MAC cannot tell apart is two values this tenant itself wrote for the same
key (a replay of its own older value): see docs/security.md.

Threads: `ValueMac` keeps nothing but its key, so the client's MAC threads seal and check at once.
"""

from __future__ import annotations

import hmac
import struct
from typing import Sequence, TypeVar

import numpy as np

from kvfsm.mooncake.errors import ChecksumMismatch
from kvfsm.mooncake.secret import ValueKey

TAG_BYTES = 32
"""BLAKE3's full output: forging a tag takes 2**256 tries (2**128 for a collision of two values' tags)."""
TRAILER = struct.Struct(f"<{TAG_BYTES}sIIQ")
"""MAC tag, carried block checksum, whether one is carried (0 or 1), payload length."""
TRAILER_BYTES = TRAILER.size
_HEADER = struct.Struct("<8sIIQI")
"""What the MAC covers beside the payload: format, carried flag and checksum, payload length, key length."""
_FORMAT = b"kvfsm-v4"
TRAILER_SUFFIX = "/trailer"
T = TypeVar("T")
E = TypeVar("E", bound=Exception)


def trailer_key(key: str) -> str:
    """The store key of the trailer of the value stored under `key`."""
    return key + TRAILER_SUFFIX


def object_names(keys: Sequence[str]) -> list[str]:
    """The store objects of the values under `keys`: every payload, then every trailer, in `keys`' order (the
    order the client's batch calls and their answers take)."""
    return list(keys) + [trailer_key(key) for key in keys]


def per_key(answers: Sequence[T]) -> list[tuple[T, T]]:
    """Answers of a call on `object_names(keys)` paired per key: (its payload's, its trailer's)."""
    count = len(answers) // 2
    return list(zip(answers[:count], answers[count:], strict=True))


def first_per_key(faults: Sequence[E | None]) -> list[E | None]:
    """Per key, the first fault of its payload's and its trailer's (`faults` of a call on `object_names(keys)`)."""
    return [payload or trailer for payload, trailer in per_key(faults)]


class ValueMac:
    """Seals and checks the values of one tenant (its `ValueKey`); safe to use from several threads at once."""

    def __init__(self, key: ValueKey) -> None:
        self._key = key

    def _tag(self, key: str, payload: np.ndarray, carried: int | None) -> bytes:
        """Keyed BLAKE3 of the header, the key and the payload (read in place, never copied, the GIL released)."""
        name = key.encode()
        header = _HEADER.pack(_FORMAT, carried is not None, carried or 0, payload.nbytes, len(name)) + name
        hasher = self._key.hasher()
        hasher.update(header)
        hasher.update(memoryview(payload))
        return hasher.digest(TAG_BYTES)

    def seal(self, trailer: np.ndarray, key: str, payload: np.ndarray, carried: int | None = None) -> int:
        """Fill `trailer` (TRAILER_BYTES uint8) for `payload` stored under `key`, carrying the block's checksum
        `carried` if the engine keeps one; returns the value's own checksum (its tag's first 8 bytes)."""
        tag = self._tag(key, payload, carried)
        trailer[:] = np.frombuffer(TRAILER.pack(tag, carried or 0, carried is not None, payload.nbytes), np.uint8)
        return int.from_bytes(tag[:8], "little")

    def check(self, trailer: np.ndarray, key: str, payload: np.ndarray) -> int | None:
        """The block checksum the value carries (None if it carries none) when `trailer` is this tenant's seal of
        exactly these `payload` bytes under `key`; else `ChecksumMismatch`."""
        tag, carried, has, length = TRAILER.unpack(trailer.tobytes())
        if length != payload.nbytes:
            raise ChecksumMismatch(f"{key}: the value holds {length} bytes, the slot {payload.nbytes}")
        if has not in (0, 1) or not hmac.compare_digest(tag, self._tag(key, payload, carried if has else None)):
            raise ChecksumMismatch(f"{key}: the value's MAC does not verify (not written by this tenant, or corrupted)")
        return carried if has else None

    def checksum_of(self, trailer: np.ndarray) -> int:
        """The value's own checksum as `seal` answered it (for a value found in the store and verified)."""
        return int.from_bytes(bytes(trailer[:8]), "little")

    def __repr__(self) -> str:
        return "ValueMac(<key hidden>)"
