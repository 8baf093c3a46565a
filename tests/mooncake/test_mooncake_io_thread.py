"""The Mooncake client's I/O thread: one daemon thread named for kvfsm (a hung store call never holds up the
process's exit, and a thread dump names it); a call cancelled before it starts answers its cancellation and never
runs."""

from __future__ import annotations

import threading

from kvfsm.mooncake.io_thread import CancellableCall, IoThread


def test_the_io_thread_is_a_daemon_named_for_kvfsm() -> None:
    before = set(threading.enumerate())  # other tests' clients may still run threads of the same name
    io = IoThread()
    try:
        [thread] = set(threading.enumerate()) - before
        assert thread.name == "kvfsm-mooncake-io"
        assert thread.daemon, "a hung store call would hold up the process's exit"
    finally:
        io.shutdown()


def test_a_call_cancelled_before_it_starts_answers_its_cancellation_and_never_runs() -> None:
    ran: list[bool] = []
    call = CancellableCall(lambda: ran.append(True) or "ran", lambda: "cancelled")
    assert call.cancel()
    assert call() == "cancelled" and ran == []
    assert call.cancel() and call.cancelled  # it stays cancelled


def test_a_call_that_started_cannot_be_cancelled() -> None:
    call = CancellableCall(lambda: "ran", lambda: "cancelled")
    assert call() == "ran"
    assert not call.cancel() and not call.cancelled
