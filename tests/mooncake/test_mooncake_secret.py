"""The tenant's value key and its MAC hide the secret in what they show, refuse pickling, and an unreadable secret
file is refused by name: the words an operator reads, kept exact."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

pytest.importorskip("blake3")

from kvfsm.mooncake.secret import SecretUnavailable, ValueKey, load_value_key  # noqa: E402
from kvfsm.mooncake.value import ValueMac  # noqa: E402

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
