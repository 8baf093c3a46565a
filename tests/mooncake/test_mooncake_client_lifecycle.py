"""The client's life beyond its calls, against a real master: how `connect` probes the master, how `close` bounds
its wait and refuses calls after it, which threads run what, and how the back-off and the backlog count calls. A call
that never returns is the real store wrapped so that one of its methods waits for the test's release."""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from test_mooncake_client import WAIT_S, faults, moved, registered, write  # noqa: E402
from test_mooncake_value_halves import Wrapped  # noqa: E402

from kvfsm.mooncake import client as client_module  # noqa: E402
from kvfsm.mooncake.client import MooncakeClient  # noqa: E402
from kvfsm.mooncake.errors import StoreTimeout, StoreUnavailable  # noqa: E402
from kvfsm.mooncake.local import MasterAddress  # noqa: E402
from kvfsm.mooncake.secret import ValueKey  # noqa: E402
from kvfsm.mooncake.settings import ClientSettings  # noqa: E402
from kvfsm.mooncake.value import ValueMac  # noqa: E402
from kvfsm.testing.mooncake_store import tenant_mac  # noqa: E402
from kvfsm.tiers.io import ManualIo  # noqa: E402

NOT_CONNECTED = "the Mooncake client is not connected"
STILL_RUNNING = "Mooncake client: calls still running at close; its registered memory stays in use"
RELEASE_S = 4.0
"""A held call is released after this long whatever the test does, so a close that waits for it still ends."""


def release_later(event: threading.Event) -> None:
    timer = threading.Timer(RELEASE_S, event.set)
    timer.daemon = True
    timer.start()


class Held:
    """The real store, but the named method waits for `release` first; once closed, it is never called again (a
    closed store's handle crashes) and answers an error code per key instead."""

    def __init__(self, store: Any, method: str) -> None:
        self.store, self.method = store, method
        self.release, self.entered = threading.Event(), threading.Event()
        self.closed = False
        self.returned_before_close: bool | None = None
        release_later(self.release)

    def __getattr__(self, name: str) -> Any:
        if name != self.method:
            return getattr(self.store, name)

        def held(keys: list[str], *args: Any) -> list[int]:
            self.entered.set()
            self.release.wait()
            return [-1] * len(keys) if self.closed else getattr(self.store, name)(keys, *args)
        return held

    def close(self) -> None:
        if self.returned_before_close is None:
            self.returned_before_close = not self.entered.is_set() or self.release.is_set()
        self.closed = True
        self.store.close()


@pytest.fixture
def held(mooncake, connect, request) -> Iterator[tuple[MooncakeClient, Held]]:
    """A connected client whose store holds the method the test's parameter names."""
    client = connect(mooncake)
    holder = client._store = Held(client.raw(), request.param)
    yield client, holder
    holder.release.set()


@pytest.mark.parametrize("held, given, waited_s", [("batch_remove", 0.3, None), ("batch_remove", None, 0.3)],
                         indirect=["held"], ids=["timeout_s given", "connect_timeout_s"])
def test_a_close_that_outlasts_its_wait_answers_false_logs_why_and_refuses_calls(
        held, caplog, given: float | None, waited_s: float | None) -> None:
    client, holder = held
    if waited_s is not None:
        client.settings = client.settings.model_copy(update={"connect_timeout_s": waited_s})
    running = client.remove(["held"])
    assert holder.entered.wait(WAIT_S)
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="kvfsm.mooncake.client"):
        assert client.close(timeout_s=given) is False
    assert time.monotonic() - started < 2.0, "close waited past its bound"
    assert [record.getMessage() for record in caplog.records] == [STILL_RUNNING]
    assert not client.connected
    [refused] = faults(client.remove(["after close"]))
    assert type(refused) is StoreUnavailable and str(refused) == NOT_CONNECTED
    holder.release.set()
    assert running.wait(WAIT_S) is not None


class HeldSeal(ValueMac):
    """A sealer whose seals wait for `release`: a MAC thread busy when close comes."""

    def __init__(self, key: ValueKey) -> None:
        super().__init__(key)
        self.release = threading.Event()
        release_later(self.release)

    def seal(self, *args: Any, **kwargs: Any) -> int:
        self.release.wait()
        return super().seal(*args, **kwargs)


@pytest.mark.parametrize("busy", ["I/O thread", "lookup thread", "MAC thread"])
def test_a_close_after_one_that_timed_out_waits_for_no_thread(mooncake, connect, request, busy: str) -> None:
    mac = HeldSeal(ValueKey.derive(b"a test tenant's secret, 32 bytes or more", None))
    client = connect(mooncake, mac=mac) if busy == "MAC thread" else connect(mooncake)
    holder = client._store = Held(client.raw(), "batch_is_exist" if busy == "lookup thread" else "batch_remove")
    try:
        if busy == "MAC thread":
            write(client, registered(client), [request.node.name], [0])
        elif busy == "lookup thread":
            client.contains(["held"])
        else:
            client.remove(["held"])
        assert client.close(timeout_s=0.2) is False
        started = time.monotonic()
        client.close(timeout_s=0.2)
        assert time.monotonic() - started < 1.0, f"the second close waited for the {busy}"
    finally:
        holder.release.set()
        mac.release.set()


@pytest.mark.parametrize("held", ["batch_is_exist"], indirect=True)
def test_close_closes_the_store_only_after_the_lookups_queued_before_it_returned(held) -> None:
    client, holder = held
    lookup = client.contains(["absent"])
    assert holder.entered.wait(WAIT_S)
    threading.Timer(0.3, holder.release.set).start()
    assert client.close(timeout_s=WAIT_S)
    assert holder.returned_before_close, "the store was closed under a lookup still running"
    assert lookup.wait(WAIT_S) == [False]


class Recorded:
    """The real store, recording which thread each lookup ran on."""

    def __init__(self, store: Any) -> None:
        self.store, self.threads = store, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.threads.append(threading.current_thread())
        return self.store.batch_is_exist(keys)


def test_lookups_run_on_a_daemon_thread_named_for_kvfsm(mooncake, connect) -> None:
    client = connect(mooncake)
    recorded = client._store = Recorded(client.raw())
    assert client.contains(["absent"]).wait(WAIT_S) == [False]
    [thread] = recorded.threads
    assert thread.name == "kvfsm-mooncake-lookup" and thread.daemon


class RecordedSeal(ValueMac):
    """A sealer recording the thread of each seal, slow enough that a pool with room would start more threads."""

    def __init__(self, key: ValueKey) -> None:
        super().__init__(key)
        self.threads: set[str] = set()

    def seal(self, *args: Any, **kwargs: Any) -> int:
        self.threads.add(threading.current_thread().name)
        time.sleep(0.02)
        return super().seal(*args, **kwargs)


def test_values_are_sealed_on_hash_threads_threads_named_for_kvfsm(mooncake, connect, request) -> None:
    mac = RecordedSeal(ValueKey.derive(b"a test tenant's secret, 32 bytes or more", None))
    client = connect(mooncake, mac=mac, hash_threads=1)
    assert moved(write(client, registered(client), [f"{request.node.name}-{i}" for i in range(4)], [0, 1, 2, 3]))
    [name] = mac.threads
    assert name.startswith("kvfsm-mooncake-mac")


def test_the_trailers_put_runs_on_a_mac_thread_so_a_client_runs_no_more_than_hash_threads(mooncake, connect,
                                                                                            request) -> None:
    """`hash_threads` bounds the cores a client's integrity work takes beside the engine: the task that puts the
    trailers waits its turn on the MAC threads rather than starting one more."""
    mac = RecordedSeal(ValueKey.derive(b"a test tenant's secret, 32 bytes or more", None))
    client = connect(mooncake, mac=mac, hash_threads=1)
    store, putting = client._store, set()

    def put(names: list[str], *args: Any) -> list[int]:
        putting.add(threading.current_thread().name)
        return store.batch_put_from(names, *args)

    client._store = Wrapped(store, batch_put_from=put)
    assert moved(write(client, registered(client), [f"{request.node.name}-{i}" for i in range(4)], [0, 1, 2, 3]))
    assert {name for name in putting | mac.threads if name.startswith("kvfsm-mooncake-mac")} == mac.threads


class Clock:
    """The client's clock, read by `_submit` and `_back_off`, set by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def queued(mooncake, monkeypatch) -> Iterator[tuple[MooncakeClient, ManualIo, Clock]]:
    """A connected client whose calls wait in a queue the test runs, on a clock the test sets (it starts at 0:
    `time.monotonic`'s origin is undefined)."""
    clock, io = Clock(0.0), ManualIo()
    monkeypatch.setattr(client_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    client = MooncakeClient(ClientSettings(master=mooncake.address, op_timeout_s=1.0, retry_after_s=5.0),
                            tenant_mac(), io=io)
    client.connect()
    yield client, io, clock
    client.close()


def test_a_new_client_serves_its_first_call_whatever_its_clock_reads(queued) -> None:
    client, io, _ = queued
    client.remove(["first"])
    assert len(io.queue) == 1, "the first call was refused"


def test_after_a_call_timed_out_calls_are_refused_for_retry_after_s_saying_why(queued) -> None:
    client, io, clock = queued
    late = client.remove(["late"])
    assert isinstance(late.poll(now=clock.now + 1.0)[0], StoreTimeout)
    clock.now = 5.0 - 1e-6
    [refused] = faults(client.remove(["refused"]))
    assert type(refused) is StoreUnavailable and str(refused) == "the store was unreachable or slow moments ago"
    clock.now = 5.0
    client.remove(["served"])
    assert len(io.queue) == 2, "a call was refused after the back-off ended"


def test_a_call_cancelled_in_the_queue_gives_back_its_place_in_the_backlog(queued) -> None:
    client, io, clock = queued
    late = client.remove(["late"])
    assert client.backlog == 1
    assert isinstance(late.poll(now=clock.now + 1.0)[0], StoreTimeout)
    io.run_all()
    assert client.backlog == 0


class RefusedRegistration:
    """The real store, but `register_buffer` answers an error code and registers nothing."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def register_buffer(self, start: int, size: int) -> int:
        return -1


def test_a_registration_the_store_refuses_is_the_calls_answer_naming_the_size_and_code(mooncake, connect) -> None:
    client = connect(mooncake)
    client._store = RefusedRegistration(client.raw())
    with pytest.raises(StoreUnavailable) as refused:
        client.register(np.zeros(4096, dtype=np.uint8))
    assert str(refused.value) == "register_buffer of 4096 bytes failed: -1"


class ShortAnswers:
    """The real store, but a removal answers one code fewer than it was given keys: a store gone wrong."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def batch_remove(self, keys: list[str], force: bool) -> list[int]:
        return self.store.batch_remove(keys, force)[:-1]


def test_a_store_answering_fewer_codes_than_keys_fails_the_call_rather_than_answer_some_keys(mooncake,
                                                                                           connect) -> None:
    client = connect(mooncake)
    client._store = ShortAnswers(client.raw())
    with pytest.raises(ValueError):
        client.remove(["a", "b"]).wait(WAIT_S)


class ShortPresence(ShortAnswers):
    """The real store, but a presence query answers one code fewer than it was given names."""

    def batch_is_exist(self, names: list[str]) -> list[int]:
        return self.store.batch_is_exist(names)[:-1]


def test_a_presence_query_answered_short_fails_the_write_back_rather_than_write_some_keys(mooncake, connect,
                                                                                           request) -> None:
    client = connect(mooncake)
    source = registered(client)
    client._store = ShortPresence(client.raw())
    with pytest.raises(ValueError):
        write(client, source, [f"{request.node.name}-{i}" for i in range(2)], [0, 1]).wait(WAIT_S)


def test_a_master_port_that_never_answers_is_given_up_after_a_second(unanswering_port: int) -> None:
    client = MooncakeClient(ClientSettings(master=MasterAddress(host="127.0.0.1", port=unanswering_port)), tenant_mac())
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        client.connect()
    assert 0.9 < time.monotonic() - started < 1.6
    assert client.close()


def test_connect_probes_the_masters_own_host_not_this_one() -> None:
    listener = socket.socket()  # something listens on this host's loopback, at the master's port, not on its host
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    master = MasterAddress(host="127.0.0.2", port=listener.getsockname()[1])
    client = MooncakeClient(ClientSettings(master=master, connect_timeout_s=0.5), tenant_mac())
    try:
        with pytest.raises(StoreUnavailable) as refused:
            client.connect()
        assert str(refused.value) == f"no Mooncake master listens on {master}"
    finally:
        listener.close()
        assert client.close()

