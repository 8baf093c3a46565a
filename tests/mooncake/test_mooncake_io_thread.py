"""The Mooncake client's I/O thread: one daemon thread named for kvfsm (a hung store call never holds up the
process's exit, and a thread dump names it) that runs calls in submission order, hands a call's exception to its
future and goes on; a call cancelled before it starts answers its cancellation and never runs; a pending answer is
`None` until its call returns or its deadline passes, reports a late call once, and a wait on it re-polls in short
slices and never waits past its timeout.

The waits are checked on a simulated clock (`Clock`, patched into the module) with a call that never answers
(`NeverAnswers`), so their slices are exact and a wait that would never end fails instead of hanging."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from kvfsm.mooncake import io_thread
from kvfsm.mooncake.io_thread import CancellableCall, IoThread, Pending

SLICE_S = 0.01
"""How long a wait blocks on its call before it polls again (the deadline, a cancellation)."""


class Clock:
    """A monotonic clock that moves only when a wait on `NeverAnswers` lets time pass."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class NeverAnswers(Future[str]):
    """The future of a call stalled for good: each wait on it lets the clock run the time waited, then times out."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.waits: list[float] = []

    def exception(self, timeout: float | None = None) -> BaseException | None:
        assert timeout is not None and timeout > 0, f"a wait of {timeout} s: for ever, or on nothing"
        self.waits.append(timeout)
        self.clock.now += timeout
        raise TimeoutError


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(io_thread, "time", clock)
    return clock


def test_the_io_thread_is_a_daemon_named_for_kvfsm() -> None:
    before = set(threading.enumerate())  # other tests' clients may still run threads of the same name
    io = IoThread()
    try:
        [thread] = set(threading.enumerate()) - before
        assert thread.name == "kvfsm-mooncake-io"
        assert thread.daemon, "a hung store call would hold up the process's exit"
    finally:
        io.shutdown()


def test_calls_run_in_submission_order() -> None:
    ran: list[int] = []
    io = IoThread()
    for n in range(5):
        io.submit(lambda n=n: ran.append(n))
    io.shutdown()
    assert ran == [0, 1, 2, 3, 4]


def test_a_call_that_raises_hands_its_exception_to_its_future_and_the_thread_runs_the_next_call() -> None:
    def fails() -> None:
        raise ValueError("refused")

    io = IoThread()
    try:
        with pytest.raises(ValueError, match="refused"):
            io.submit(fails).result(timeout=5.0)
        assert io.submit(lambda: "next").result(timeout=5.0) == "next"
    finally:
        io.shutdown()


def test_shutdown_waits_for_the_calls_queued_before_it() -> None:
    io = IoThread()
    queued = io.submit(lambda: time.sleep(0.2))
    io.shutdown()
    assert queued.done()


def test_shutdown_without_waiting_returns_while_a_call_still_runs() -> None:
    release = threading.Event()
    io = IoThread()
    running = io.submit(lambda: release.wait(5.0))
    io.shutdown(wait=False)
    assert not running.done()
    release.set()
    assert running.result(timeout=5.0) is True


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


def test_a_queued_call_answers_none_before_its_deadline_and_its_timeout_answer_from_it() -> None:
    late: list[bool] = []
    call = CancellableCall(lambda: "ran", lambda: "cancelled")
    pending = Pending(Future(), call, 10.0, lambda: late.append(True), "timed out")
    assert pending.poll(now=9.5) is None and late == []
    assert pending.poll(now=10.0) == "timed out" and call.cancelled and late == [True]


def test_a_running_call_past_its_deadline_is_reported_late_once_however_often_it_is_polled() -> None:
    late: list[bool] = []
    call = CancellableCall(lambda: "ran", lambda: "cancelled")
    call()  # it started: it can no longer be cancelled, its answer is still to come
    pending = Pending(Future(), call, 10.0, lambda: late.append(True), "timed out")
    assert [pending.poll(now=now) for now in (10.0, 11.0, 12.0)] == [None, None, None]
    assert late == [True]


def test_a_wait_answers_as_soon_as_its_call_returns() -> None:
    io = IoThread()
    try:
        pending = Pending(io.submit(lambda: "answer"), None, time.monotonic() + 60.0, lambda: None, "timed out")
        started = time.monotonic()
        assert pending.wait(2.0) == "answer"
        assert time.monotonic() - started < 1.0, "it waited out its timeout"
    finally:
        io.shutdown()


def test_a_wait_polls_in_slices_of_at_most_ten_milliseconds_the_last_cut_to_its_end(clock: Clock) -> None:
    stalled = NeverAnswers(clock)
    assert Pending(stalled, None, 60.0, lambda: None, "timed out").wait(0.025) is None
    assert stalled.waits == pytest.approx([SLICE_S, SLICE_S, 0.005])
    assert clock.now == pytest.approx(0.025)


def test_a_wait_of_no_time_polls_once_and_waits_on_nothing(clock: Clock) -> None:
    stalled = NeverAnswers(clock)
    assert Pending(stalled, None, 60.0, lambda: None, "timed out").wait(0.0) is None
    assert stalled.waits == []


def test_a_wait_answers_a_queued_calls_timeout_at_its_deadline_not_at_the_end_of_the_wait(clock: Clock) -> None:
    call = CancellableCall(lambda: "ran", lambda: "cancelled")
    pending = Pending(NeverAnswers(clock), call, 0.02, lambda: None, "timed out")
    assert pending.wait(1.0) == "timed out"
    assert clock.now == pytest.approx(0.02)
