"""The client's calls beyond a write-back and a fetch, against a real master: registering host memory (a tensor or
a numpy array), removing values (even those a reader leases), and the words of each refusal, since the tier's log
is where an operator reads why a block was not stored."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from test_mooncake_client import WAIT_S, faults, moved, read, registered, write  # noqa: E402

from kvfsm.mooncake.client import MooncakeClient  # noqa: E402
from kvfsm.mooncake.errors import ChecksumMismatch, KeyMissing, StoreUnavailable  # noqa: E402
from kvfsm.mooncake.local import MasterAddress  # noqa: E402
from kvfsm.mooncake.settings import ClientSettings  # noqa: E402
from kvfsm.mooncake.value import TRAILER_BYTES, trailer_key  # noqa: E402
from kvfsm.testing.mooncake_store import tenant_mac  # noqa: E402

NOT_CONNECTED = "the Mooncake client is not connected"


def unconnected() -> MooncakeClient:
    return MooncakeClient(ClientSettings(master=MasterAddress(host="127.0.0.1", port=1)), tenant_mac())


def test_a_numpy_array_registers_as_a_tensor_does(mooncake, connect, request) -> None:
    client = connect(mooncake)
    memory = np.full(2 * (4096 + TRAILER_BYTES), 9, dtype=np.uint8)
    payload, trailer = memory[:4096], memory[4096:4096 + TRAILER_BYTES]
    client.register(memory)
    assert moved(client.write_back([request.node.name], [payload], [trailer]))


def test_registering_on_a_client_that_is_not_connected_raises_why() -> None:
    with pytest.raises(StoreUnavailable) as refused:
        unconnected().register(np.zeros(64, dtype=np.uint8))
    assert str(refused.value) == NOT_CONNECTED


class HungRegistration:
    """The real store, but `register_buffer` waits for `release`: a registration the store never answers."""

    def __init__(self, store: Any) -> None:
        self.store, self.release = store, threading.Event()

    def register_buffer(self, start: int, size: int) -> int:
        self.release.wait()
        return self.store.register_buffer(start, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_registration_that_never_answers_is_store_unavailable(mooncake, connect) -> None:
    client = connect(mooncake)
    client.settings = client.settings.model_copy(update={"op_timeout_s": 0.1, "connect_timeout_s": 0.1})
    hung = client._store = HungRegistration(client.raw())
    try:
        with pytest.raises(StoreUnavailable) as refused:
            client.register(np.zeros(4096, dtype=np.uint8))
        assert str(refused.value) == "register_buffer did not answer"
    finally:
        hung.release.set()


def test_a_removal_answers_per_key_and_removes_a_value_a_reader_leases(mooncake, connect, request) -> None:
    client = connect(mooncake)
    source = registered(client)
    leased, absent = f"{request.node.name}-leased", f"{request.node.name}-absent"
    assert moved(write(client, source, [leased], [0]))
    assert moved(read(client, source, [leased], [1]))  # the read leases the value for the master's lease TTL
    [removed, missing] = faults(client.remove([leased, absent]))
    assert removed is None
    assert type(missing) is KeyMissing and str(missing) == f"removal of {absent}: OBJECT_NOT_FOUND"
    assert client.contains([leased]).wait(WAIT_S) == [False]


def test_a_removal_on_a_client_that_is_not_connected_answers_why_for_each_key() -> None:
    answers = unconnected().remove(["a", "b"]).wait(WAIT_S)
    assert [str(answer) for answer in answers] == [NOT_CONNECTED] * 2  # type: ignore[union-attr]
    assert all(type(answer) is StoreUnavailable for answer in answers)  # type: ignore[union-attr]


def test_a_write_back_onto_a_key_whose_value_cannot_be_read_back_names_the_check(mooncake, connect,
                                                                                  request) -> None:
    """The key is present, so its value is read to be verified; a value of another length does not fit the
    buffers, and the store's refusal is the write-back's answer, naming the check that failed."""
    client = connect(mooncake)
    key = request.node.name
    assert client.raw().put(key, b"x" * 100) == 0 and client.raw().put(trailer_key(key), b"x" * 100) == 0
    [refused] = faults(write(client, registered(client), [key], [0]))
    assert type(refused) is ChecksumMismatch
    assert str(refused) == f"check of the value present under {key}: INVALID_PARAMS"
