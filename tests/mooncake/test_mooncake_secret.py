"""The tenant's value key and its MAC hide the secret in what they show, refuse pickling, and an unreadable secret
file or a value of another length is refused by name: the words an operator reads, kept exact. A value hands back
the block checksum it was sealed with."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("blake3")

from blake3 import blake3  # noqa: E402

from kvfsm.mooncake.errors import ChecksumMismatch  # noqa: E402
from kvfsm.mooncake.secret import SecretUnavailable, ValueKey, load_value_key  # noqa: E402
from kvfsm.mooncake.value import TAG_BYTES, TRAILER, TRAILER_BYTES, ValueMac  # noqa: E402

KEY = ValueKey.derive(b"a secret of thirty-two bytes or more, for tests", "tenant")


def test_a_value_key_and_its_mac_show_their_names_and_nothing_of_the_key() -> None:
    assert repr(KEY) == str(KEY) == "ValueKey(<hidden>)"
    assert repr(ValueMac(KEY)) == "ValueMac(<key hidden>)"


def test_pickling_a_value_key_is_refused_with_the_reason() -> None:
    with pytest.raises(TypeError) as refused:
        pickle.dumps(KEY)
    assert str(refused.value) == "a value key is never pickled: each process reads the secret itself"


def test_an_unreadable_secret_file_is_refused_naming_the_file_and_the_error(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    with pytest.raises(SecretUnavailable) as refused:
        load_value_key(absent, "UNUSED", None)
    assert str(refused.value) == f"the Mooncake secret file {absent} cannot be read: No such file or directory"


def _sealed(payload_bytes: int, carried: int | None) -> tuple[ValueMac, np.ndarray]:
    mac = ValueMac(KEY)
    trailer = np.zeros(TRAILER_BYTES, np.uint8)
    mac.seal(trailer, "k", np.arange(payload_bytes, dtype=np.uint8), carried)
    return mac, trailer


def test_a_value_hands_back_the_block_checksum_it_was_sealed_with() -> None:
    mac, trailer = _sealed(8, 0xC0FFEE)
    assert mac.check(trailer, "k", np.arange(8, dtype=np.uint8)) == 0xC0FFEE
    mac, trailer = _sealed(8, None)
    assert mac.check(trailer, "k", np.arange(8, dtype=np.uint8)) is None


def test_a_value_sealed_for_another_length_is_refused_naming_both_lengths() -> None:
    mac, trailer = _sealed(8, None)
    with pytest.raises(ChecksumMismatch) as refused:
        mac.check(trailer, "k", np.arange(4, dtype=np.uint8))
    assert str(refused.value) == "k: the value holds 8 bytes, the slot 4"


def test_a_value_key_of_another_length_is_refused_naming_the_length() -> None:
    with pytest.raises(ValueError) as refused:
        ValueKey(bytes(16))
    assert str(refused.value) == "a value key is 32 bytes"


def test_a_tenant_left_unset_is_the_empty_tenant_name() -> None:
    """As in the store keys (`kvfsm.mooncake.keys`: an empty salt is no salt), so both name one tenant's values."""
    secret = b"a secret of thirty-two bytes or more, for tests"
    mac, payload, trailer = ValueMac(ValueKey.derive(secret, None)), np.arange(8, dtype=np.uint8), np.zeros(
        TRAILER_BYTES, np.uint8)
    mac.seal(trailer, "k", payload)
    ValueMac(ValueKey.derive(secret, "")).check(trailer, "k", payload)


RAW_KEY = bytes(range(32))


def documented_trailer(key: str, payload: bytes, carried: int | None) -> bytes:
    """A trailer built from the format kvfsm.mooncake.value documents, with the `blake3` package alone: keyed BLAKE3
    under the value key of the header, the key and the payload; then the tag, the carried checksum (0 if none),
    whether one is carried, the payload's length."""
    header = struct.pack("<8sIIQI", b"kvfsm-v4", carried is not None, carried or 0, len(payload), len(key))
    tag = blake3(header + key.encode() + payload, key=RAW_KEY).digest(TAG_BYTES)
    return TRAILER.pack(tag, carried or 0, carried is not None, len(payload))


@pytest.mark.parametrize("carried", [None, 0xC0FFEE])
def test_a_value_of_the_documented_format_verifies_and_a_seal_writes_that_format(carried: int | None) -> None:
    """Values outlive the process that wrote them (other engines, later kvfsm versions read them): the format is
    what the module documents, checked against an independent construction, not only against itself."""
    mac, payload = ValueMac(ValueKey(RAW_KEY)), np.arange(64, dtype=np.uint8)
    built = np.frombuffer(documented_trailer("k", payload.tobytes(), carried), np.uint8)
    assert mac.check(built, "k", payload) == carried
    sealed = np.zeros(TRAILER_BYTES, np.uint8)
    mac.seal(sealed, "k", payload, carried)
    assert sealed.tobytes() == built.tobytes()


def test_a_value_key_is_blake3s_derivation_of_the_tenant_and_the_secret_under_kvfsms_context() -> None:
    """Engines of one tenant on other hosts, and later kvfsm versions, must derive the same key from the same
    secret: the derivation is the documented one, built independently here."""
    secret = b"a secret of thirty-two bytes or more, for tests"
    material = len(b"tenant").to_bytes(4, "little") + b"tenant" + secret
    raw = blake3(material, derive_key_context="kvfsm 2026-11-28 mooncake value MAC key v4").digest()
    payload, trailer = np.arange(8, dtype=np.uint8), np.zeros(TRAILER_BYTES, np.uint8)
    ValueMac(ValueKey(raw)).seal(trailer, "k", payload, None)
    derived = ValueKey.derive(secret, "tenant")  # derived here, not at import: the derivation under test runs now
    assert ValueMac(derived).check(trailer, "k", payload) is None


SECRET = "s" * 32
"""Exactly `MIN_SECRET_BYTES`: the shortest secret accepted."""


def test_an_unset_secret_variable_is_refused_naming_it_and_the_file_alternative(monkeypatch) -> None:
    monkeypatch.delenv("KVFSM_TEST_SECRET", raising=False)
    with pytest.raises(SecretUnavailable) as refused:
        load_value_key(None, "KVFSM_TEST_SECRET", None)
    assert str(refused.value) == ("the environment variable KVFSM_TEST_SECRET that should hold the Mooncake secret is "
                                  "not set (or configure secret_file)")


def test_a_secret_of_the_least_length_is_accepted_and_one_byte_shorter_refused_naming_both_lengths(
        monkeypatch) -> None:
    """Whitespace around the secret is stripped before it is measured (a file's final newline is no secret)."""
    monkeypatch.setenv("KVFSM_TEST_SECRET", f" {SECRET}\n")
    assert isinstance(load_value_key(None, "KVFSM_TEST_SECRET", None), ValueKey)
    monkeypatch.setenv("KVFSM_TEST_SECRET", f" {SECRET[1:]}\n")
    with pytest.raises(SecretUnavailable) as refused:
        load_value_key(None, "KVFSM_TEST_SECRET", None)
    assert str(refused.value) == ("the Mooncake secret in the environment variable KVFSM_TEST_SECRET is 31 bytes; at "
                                  "least 32 are needed (e.g. `openssl rand -hex 32`)")


def test_one_secret_gives_each_tenant_its_own_value_key(monkeypatch) -> None:
    """A value sealed under one tenant's key fails the check of another tenant's key from the same secret."""
    monkeypatch.setenv("KVFSM_TEST_SECRET", SECRET)
    payload, trailer = np.arange(8, dtype=np.uint8), np.zeros(TRAILER_BYTES, np.uint8)
    ValueMac(load_value_key(None, "KVFSM_TEST_SECRET", "tenant-a")).seal(trailer, "k", payload, None)
    assert ValueMac(load_value_key(None, "KVFSM_TEST_SECRET", "tenant-a")).check(trailer, "k", payload) is None
    with pytest.raises(ChecksumMismatch):
        ValueMac(load_value_key(None, "KVFSM_TEST_SECRET", None)).check(trailer, "k", payload)
