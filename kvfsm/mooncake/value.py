"""The stored value of one block: the slot's bytes, then a 44-byte trailer that lets a reader refuse any value its
tenant did not write.

The store guarantees that a get sees only a completely written object, not that the object under a key is one this
tenant wrote for it: every client of the master may put any bytes under any key it can name, and keys are derived
from configuration anyone can guess (`kvfsm.mooncake.keys`). So the trailer holds a MAC: AES-256-GMAC (the tag of
AES-GCM, from the `cryptography` package, under the tenant's `ValueKey` and a random 96-bit nonce the trailer
carries) over the key, the payload's length, the block's own checksum (when the engine carries one) and every payload
byte. A reader recomputes it before the slot may become loadable; a value whose MAC does not verify (another writer's,
a corrupted one, a value of an older format) is `ChecksumMismatch`, a failed fetch. The MAC subsumes the former
CRC-32 trailer: a keyed MAC detects accidental corruption as well as forgery.

Why GMAC: every byte of every value is MACed on the path of a transfer, and GHASH runs on the carry-less multiply
instructions of every x86 and Arm server core, about twice BLAKE3's rate per core (docs/mooncake.md), so a round of
the MAC threads costs a write-back and a fetch less time before their first put and after their last get. A GMAC key
must never see one nonce twice: a fresh random nonce per seal keeps that likely for 2**32 seals per key (NIST SP
800-38D's bound), far beyond a tenant's lifetime of writes; docs/security.md says what to do beyond it.

The block's own checksum (`OffloadConfig.checksum`: the CRC-32 the CPU pool took when the block was first stored)
travels in the trailer, under the MAC, so a fetch hands it back and the load that follows is checked against the
bytes as first stored, not as found in the store.

The trailer travels in the same object as the payload (one multi-buffer put), so a value and its trailer can never
come from two different writes. What the MAC cannot tell apart is two values this tenant itself wrote for the same
key (a replay of its own older value): see docs/security.md.
"""

from __future__ import annotations

import hmac
import os
import struct

import numpy as np

from kvfsm.mooncake.errors import ChecksumMismatch
from kvfsm.mooncake.secret import ValueKey

TAG_BYTES = 16
"""128-bit tags: forging one takes 2**128 tries; a longer tag would only grow every value."""
NONCE_BYTES = 12
"""GCM's own nonce length (any other is hashed into one first)."""
TRAILER = struct.Struct(f"<{TAG_BYTES}s{NONCE_BYTES}sIIQ")
"""MAC tag, its nonce, carried block checksum, whether one is carried (0 or 1), payload length."""
TRAILER_BYTES = TRAILER.size
_HEADER = struct.Struct("<8sIIQI")
"""What the MAC covers beside the payload: format, carried flag and checksum, payload length, key length."""
_FORMAT = b"kvfsm-v3"


class ValueMac:
    """Seals and checks the values of one tenant (its `ValueKey`); safe to use from several threads at once."""

    def __init__(self, key: ValueKey) -> None:
        self._key = key

    def _tag(self, key: str, nonce: bytes, payload: np.ndarray, carried: int | None) -> bytes:
        """GCM's tag with the header and key as its plaintext and the payload as its associated data (read in place,
        never copied): the tag covers both; the ciphertext of the header is dropped. A cipher per call, so that the
        MAC threads share nothing."""
        name = key.encode()
        header = _HEADER.pack(_FORMAT, carried is not None, carried or 0, payload.nbytes, len(name)) + name
        return self._key.cipher().encrypt(nonce, header, memoryview(payload))[-TAG_BYTES:]

    def seal(self, trailer: np.ndarray, key: str, payload: np.ndarray, carried: int | None = None) -> int:
        """Fill `trailer` (TRAILER_BYTES uint8) for `payload` stored under `key`, carrying the block's checksum
        `carried` if the engine keeps one; returns the value's own checksum (its tag's first 8 bytes)."""
        nonce = os.urandom(NONCE_BYTES)
        tag = self._tag(key, nonce, payload, carried)
        trailer[:] = np.frombuffer(TRAILER.pack(tag, nonce, carried or 0, carried is not None, payload.nbytes),
                                   np.uint8)
        return int.from_bytes(tag[:8], "little")

    def check(self, trailer: np.ndarray, key: str, payload: np.ndarray) -> int | None:
        """The block checksum the value carries (None if it carries none) when `trailer` is this tenant's seal of
        exactly these `payload` bytes under `key`; else `ChecksumMismatch`."""
        tag, nonce, carried, has, length = TRAILER.unpack(trailer.tobytes())
        if length != payload.nbytes:
            raise ChecksumMismatch(f"{key}: the value holds {length} bytes, the slot {payload.nbytes}")
        if has not in (0, 1) or not hmac.compare_digest(tag, self._tag(key, nonce, payload, carried if has else None)):
            raise ChecksumMismatch(f"{key}: the value's MAC does not verify (not written by this tenant, or corrupted)")
        return carried if has else None

    def checksum_of(self, trailer: np.ndarray) -> int:
        """The value's own checksum as `seal` answered it (for a value found in the store and verified)."""
        return int.from_bytes(bytes(trailer[:8]), "little")

    def __repr__(self) -> str:
        return "ValueMac(<key hidden>)"
