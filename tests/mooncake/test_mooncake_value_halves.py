"""A value is two objects, its payload and its trailer, and only a whole one counts: a lookup holds a key only
when both are there, no payload waits for a seal, the trailers' put runs beside the payloads', a trailer outlives
its call only over a stored payload, a half left in the store (by a write-back that stopped between its puts, an
eviction, a plant) is removed before this tenant writes the key, and removing a value removes both objects."""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("mooncake.store")

from test_mooncake_client import SLOT, WAIT_S, faults, moved, read, registered, write  # noqa: E402

from kvfsm.mooncake.errors import ChecksumMismatch, KeyMissing, StoreRejected, StoreUnavailable  # noqa: E402
from kvfsm.mooncake.secret import ValueKey  # noqa: E402
from kvfsm.mooncake.value import TRAILER_BYTES, ValueMac, trailer_key  # noqa: E402

FORGED = 0xA5
TRANSFER_FAIL = -800
OBJECT_HAS_LEASE = -706


class Wrapped:
    """The client's store, with some calls answered otherwise (a store gone wrong at one step)."""

    def __init__(self, store: Any, **calls: Any) -> None:
        self._store = store
        self.__dict__.update(calls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def held(client: Any, key: str) -> tuple[int, int]:
    """Whether the store holds the payload and the trailer of `key` (1 or 0 each)."""
    return tuple(client.raw().batch_is_exist([key, trailer_key(key)]))  # type: ignore[return-value]


def test_a_lookup_holds_a_key_only_while_both_its_objects_are_there(mooncake, connect, request) -> None:
    client, key = connect(mooncake), request.node.name
    assert moved(write(client, registered(client), [key], [0]))
    assert faults(client.contains([key])) == [True]
    assert client.raw().remove(trailer_key(key), True) == 0
    assert faults(client.contains([key])) == [False]
    [missing] = faults(read(client, registered(client), [key], [0]))
    assert isinstance(missing, KeyMissing)


def plant_half(client: Any, key: str, half: str) -> None:
    """Another client of the master left one object of `key`: FORGED bytes of a payload's or a trailer's length."""
    name, size = (key, SLOT) if half == "payload" else (trailer_key(key), TRAILER_BYTES)
    assert client.raw().put(name, bytes([FORGED]) * size) == 0


@pytest.mark.parametrize("half", ["payload", "trailer"])
def test_a_key_the_store_holds_half_of_is_cleared_and_written_whole(mooncake, connect, request, half: str) -> None:
    client, key = connect(mooncake), request.node.name
    source, target = registered(client, seed=1), registered(client, seed=2)
    plant_half(client, key, half)
    assert moved(write(client, source, [key], [0]))
    assert moved(read(client, target, [key], [0])) and (target.payload(0) == source.payload(0)).all()


@pytest.mark.parametrize("half", ["payload", "trailer"])
def test_control_without_clearing_a_planted_half_stays_and_every_fetch_of_the_key_fails(mooncake, connect, request,
                                                                                        half: str) -> None:
    """Mooncake keeps the object a put finds present: the planted half is what readers get beside this tenant's."""
    client, key = connect(mooncake), request.node.name
    client._cleared = lambda keys, halves: {}
    plant_half(client, key, half)
    assert moved(write(client, registered(client, seed=1), [key], [0]))
    [refused] = faults(read(client, registered(client, seed=2), [key], [0]))
    assert isinstance(refused, ChecksumMismatch)


def test_a_half_the_store_will_not_remove_leaves_its_key_unwritten_naming_the_removal(mooncake, connect,
                                                                                      request) -> None:
    client, key = connect(mooncake), request.node.name
    plant_half(client, key, "payload")
    client._store = Wrapped(client._store, batch_remove=lambda names, force: [OBJECT_HAS_LEASE] * len(names))
    [refused] = faults(write(client, registered(client), [key], [0]))
    assert type(refused) is StoreRejected
    assert str(refused) == f"removal of half a value under {key}: OBJECT_HAS_LEASE"
    assert held(client, key) == (1, 0)


class GatedSeal(ValueMac):
    """A sealer whose seals wait until the payloads' put has started."""

    def __init__(self, key: ValueKey, gate: threading.Event) -> None:
        super().__init__(key)
        self.gate = gate

    def seal(self, *args: Any, **kwargs: Any) -> int:
        assert self.gate.wait(WAIT_S), "no put started while the seals waited"
        return super().seal(*args, **kwargs)


def test_a_write_back_puts_its_payloads_while_their_seals_still_run_and_its_trailers_once_sealed(mooncake, connect,
                                                                                         request) -> None:
    gate = threading.Event()
    client = connect(mooncake, mac=GatedSeal(ValueKey.derive(b"a test tenant's secret, 32 bytes or more", None), gate))
    puts: list[list[str]] = []

    def put(names: list[str], *args: Any) -> list[int]:
        puts.append(list(names))
        gate.set()
        return store.batch_put_from(names, *args)

    store = client._store
    client._store = Wrapped(store, batch_put_from=put)
    keys = [f"{request.node.name}-{i}" for i in range(3)]
    try:
        assert moved(write(client, registered(client), keys, [0, 1, 2]))
    finally:
        gate.set()
    assert puts == [keys, [trailer_key(key) for key in keys]]


def test_a_write_back_puts_its_trailers_while_its_payloads_still_move(mooncake, connect, request) -> None:
    """Once sealed, the trailers need not wait for the payloads' put to return: their put (a master round trip)
    runs beside it, and a payload the store refuses has its trailer removed again (the test after this one)."""
    trailers_put = threading.Event()
    overlapped: list[bool] = []

    def put(names: list[str], *args: Any) -> list[int]:
        if names[0].endswith(trailer_key("")):
            trailers_put.set()
        else:
            overlapped.append(trailers_put.wait(WAIT_S))
        return store.batch_put_from(names, *args)

    client = connect(mooncake)
    store = client._store
    client._store = Wrapped(store, batch_put_from=put)
    keys = [f"{request.node.name}-{i}" for i in range(3)]
    assert moved(write(client, registered(client), keys, [0, 1, 2]))
    assert overlapped == [True]


def failing_puts(client: Any, of: str) -> None:
    """The store refuses every put of payloads, or of trailers."""
    store = client._store

    def put(names: list[str], *args: Any) -> list[int]:
        trailers = names[0].endswith(trailer_key(""))
        if trailers == (of == "trailers"):
            return [TRANSFER_FAIL] * len(names)
        return store.batch_put_from(names, *args)

    client._store = Wrapped(store, batch_put_from=put)


def test_a_payload_the_store_refuses_keeps_no_trailer_and_its_fault_is_the_answer(mooncake, connect, request) -> None:
    client, key = connect(mooncake), request.node.name
    failing_puts(client, "payloads")
    [refused] = faults(write(client, registered(client), [key], [0]))
    assert str(refused) == f"write-back of {key}: TRANSFER_FAIL" and held(client, key) == (0, 0)
    assert type(refused) is StoreRejected  # a failed put read nothing: not a corrupt value


def test_a_trailer_the_store_refuses_leaves_the_value_unpublished_naming_the_trailer(mooncake, connect,
                                                                                     request) -> None:
    client, key = connect(mooncake), request.node.name
    failing_puts(client, "trailers")
    [refused] = faults(write(client, registered(client), [key], [0]))
    assert str(refused) == f"write-back of {trailer_key(key)}: TRANSFER_FAIL" and type(refused) is StoreRejected
    assert faults(client.contains([key])) == [False]


class FailingSeal(ValueMac):
    def seal(self, *args: Any, **kwargs: Any) -> int:
        raise RuntimeError("the MAC failed")


def test_a_seal_that_fails_puts_no_trailer_and_the_write_back_raises_its_error(mooncake, connect, request) -> None:
    client = connect(mooncake, mac=FailingSeal(ValueKey.derive(b"a test tenant's secret, 32 bytes or more", None)))
    key = request.node.name
    with pytest.raises(RuntimeError, match="^the MAC failed$"):
        write(client, registered(client), [key], [0]).wait(WAIT_S)
    assert held(client, key)[1] == 0


def test_removing_a_value_removes_its_payload_and_its_trailer(mooncake, connect, request) -> None:
    client, key = connect(mooncake), request.node.name
    assert moved(write(client, registered(client), [key], [0]))
    assert faults(client.remove([key])) == [None] and held(client, key) == (0, 0)


def test_a_lookup_whose_trailer_the_store_does_not_answer_is_a_fault_and_backs_off(mooncake, connect,
                                                                                   request) -> None:
    """An error for either object is no answer about the value: a fault (a miss) that refuses the store a while, not
    a 'not held' that would send the scheduler on asking."""
    client, key = connect(mooncake), request.node.name
    assert moved(write(client, registered(client), [key], [0]))
    store = client._store
    client._store = Wrapped(store, batch_is_exist=lambda names: [1] * (len(names) // 2) + [-900] * (len(names) // 2))
    [fault] = faults(client.contains([key]))
    assert type(fault) is StoreUnavailable and str(fault) == f"lookup of {key} failed"
    client._store = store
    [refused] = faults(client.contains([key]))
    assert type(refused) is StoreUnavailable, "no back-off after the failed lookup"


def test_removing_values_answers_each_key_with_the_fault_of_its_own_trailer(mooncake, connect, request) -> None:
    client = connect(mooncake)
    whole, half = f"{request.node.name}-whole", f"{request.node.name}-half"
    assert moved(write(client, registered(client), [whole, half], [0, 1]))
    assert client.raw().remove(trailer_key(half), True) == 0
    gone, missing = faults(client.remove([whole, half]))
    assert gone is None and isinstance(missing, KeyMissing) and trailer_key(half) in str(missing)


def test_a_write_back_whose_store_leaves_one_half_of_a_key_unanswered_writes_nothing_and_says_why(mooncake, connect,
                                                                                                   request) -> None:
    """A half the store did not answer for is no answer about the key: not a half to clear and write over."""
    client, key = connect(mooncake), request.node.name
    store = client._store
    client._store = Wrapped(store, batch_is_exist=lambda names: [0] * (len(names) // 2) + [-900] * (len(names) // 2))
    [fault] = faults(write(client, registered(client), [key], [0]))
    assert type(fault) is StoreUnavailable
    assert str(fault) == f"write-back of {key}: the store did not say whether it holds the key"
    assert tuple(store.batch_is_exist([key, trailer_key(key)])) == (0, 0)


def test_a_trailer_put_over_a_payload_the_store_refused_is_removed_though_a_reader_leases_it(mooncake, connect,
                                                                                              request) -> None:
    """The trailers' put runs beside the payloads', so a refused payload can leave its trailer behind: removed
    with force, since another engine may have read it meanwhile (a read leases an object for a while)."""
    client, reader, key = connect(mooncake), connect(mooncake), request.node.name
    store = client._store
    trailers_put = threading.Event()

    def put(names: list[str], *args: Any) -> list[int]:
        if names[0].endswith(trailer_key("")):
            codes = store.batch_put_from(names, *args)
            trailers_put.set()
            return codes
        assert trailers_put.wait(WAIT_S)
        assert reader.raw().get(trailer_key(key)), "the reader found no trailer to lease"
        return [TRANSFER_FAIL] * len(names)

    client._store = Wrapped(store, batch_put_from=put)
    [refused] = faults(write(client, registered(client), [key], [0]))
    assert type(refused) is StoreRejected
    assert tuple(store.batch_is_exist([key, trailer_key(key)])) == (0, 0)

