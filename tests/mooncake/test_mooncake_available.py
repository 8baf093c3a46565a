"""`kvfsm.mooncake.available()` answers whether the `mooncake` extra is usable: what decides if the demo, the
benchmark and the generated interleavings offer a Mooncake tier at all."""

from __future__ import annotations

import sys

import pytest

from kvfsm.mooncake import available


@pytest.mark.parametrize("missing", ["mooncake.store", "blake3"])
def test_without_the_store_bindings_or_the_mac_mooncake_is_not_available(monkeypatch, missing: str) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # a None entry makes its import fail
    assert available() is False


def test_with_the_store_bindings_and_the_mac_mooncake_is_available() -> None:
    pytest.importorskip("mooncake.store")
    pytest.importorskip("blake3")
    assert available() is True
