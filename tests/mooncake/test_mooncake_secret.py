"""The tenant's value key and its MAC hide the secret in what they show, refuse pickling, and an unreadable secret
file or a value of another length is refused by name: the words an operator reads, kept exact. A value hands back
the block checksum it was sealed with."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cryptography")

from kvfsm.mooncake.errors import ChecksumMismatch  # noqa: E402
from kvfsm.mooncake.secret import SecretUnavailable, ValueKey, load_value_key  # noqa: E402
from kvfsm.mooncake.value import TRAILER_BYTES, ValueMac  # noqa: E402

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
