"""When a fetch issues its gets (`kvfsm.mooncake.paced_gets`): each run lands once, on the issuing thread; with no
pace the next get waits for the one before; with a pace it is issued `lead_s` before the one before should end, so
the two overlap; a failed get stops later ones and is raised once the gets in flight returned."""

from __future__ import annotations

import threading
import time

import pytest

from kvfsm.mooncake.paced_gets import GetLanes, GetPace

WAIT_S = 10.0
RUNS = [range(0, 4), range(4, 6), range(6, 7)]


class Recorder:
    """A `get` that records when each run started and ended (seconds from its making), and `landed` calls."""

    def __init__(self, hold_s: float = 0.0, holds: dict[int, float] | None = None) -> None:
        self.t0 = time.perf_counter()
        self.hold_s, self.holds = hold_s, holds or {}
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.landed: list[tuple[range, int, int]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def get(self, run: range) -> int:
        self.started[run.start] = self.now()
        time.sleep(self.holds.get(run.start, self.hold_s))
        self.ended[run.start] = self.now()
        return run.start * 10

    def land(self, run: range, answer: int) -> None:
        self.landed.append((run, answer, threading.get_ident()))


@pytest.fixture
def lanes():
    made: list[GetLanes] = []

    def make(lead_s: float = 0.0, bytes_per_s: float | None = None) -> GetLanes:
        made.append(GetLanes(lead_s))
        made[-1].pace.bytes_per_s = bytes_per_s
        return made[-1]

    yield make
    for lane in made:
        lane.shutdown()


def test_every_run_lands_once_with_its_answer_on_the_issuing_thread(lanes) -> None:
    recorder = Recorder()
    lanes(bytes_per_s=1e12).run(RUNS, [4, 2, 1], recorder.get, recorder.land)
    assert sorted((run.start, answer) for run, answer, _ in recorder.landed) == [(0, 0), (4, 40), (6, 60)]
    assert {ident for *_, ident in recorder.landed} == {threading.get_ident()}


def test_with_no_pace_each_get_waits_for_the_one_before(lanes) -> None:
    recorder = Recorder(hold_s=0.05)
    lanes(lead_s=1.0).run(RUNS, [4 << 20, 2 << 20, 1 << 20], recorder.get, recorder.land)
    assert recorder.started[4] >= recorder.ended[0], "the second get started before the first returned"


def test_the_pace_is_learnt_from_the_first_get_of_a_fetch(lanes) -> None:
    """The first get (4 MiB held 0.1 s) teaches 40 MiB/s (more than 21 with 90 ms to spare); the others (held 0.3 s)
    would teach 7 MiB/s or less, and the second's bytes over the first's time 20 MiB/s or less."""
    gets = lanes(lead_s=1.0)
    gets.run(RUNS, [4 << 20, 2 << 20, 1 << 20], Recorder(holds={0: 0.1, 4: 0.3, 6: 0.3}).get, lambda run, answer: None)
    assert gets.pace.bytes_per_s is not None
    assert (4 << 20) / 0.19 < gets.pace.bytes_per_s <= (4 << 20) / 0.1


def test_while_the_pace_is_unknown_the_issuing_thread_waits_without_spinning(lanes) -> None:
    """The issuing thread is the client's I/O thread: spinning while a get runs would take a core from the MAC
    threads checking the values beside it."""
    spent = time.thread_time()
    lanes(lead_s=0.0).run(RUNS[:2], [4, 2], Recorder(holds={0: 0.5}).get, lambda run, answer: None)
    assert time.thread_time() - spent < 0.1


def test_each_run_lands_while_later_gets_still_run(lanes) -> None:
    """The second get returns only once the first run landed (or at the deadline): the MAC threads start on a run as
    soon as its get returned, not once every get did."""
    first_landed = threading.Event()
    waited: list[bool] = []

    def get(run: range) -> int:
        if run.start:
            waited.append(first_landed.wait(2.0))
        return 0

    def land(run: range, answer: int) -> None:
        if run.start == 0:
            first_landed.set()

    lanes(lead_s=1.0, bytes_per_s=1e12).run(RUNS[:2], [4, 2], get, land)
    assert waited == [True], "the first run landed only once the second get returned"


def test_gets_run_on_two_daemon_threads_named_for_kvfsm(lanes) -> None:
    """At most two gets are in flight at once, however early they are issued, each on a lane thread."""
    running, most, names = [0], [0], set()
    lock = threading.Lock()

    def get(run: range) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            names.add((threading.current_thread().name, threading.current_thread().daemon))
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return 0

    lanes(lead_s=1.0, bytes_per_s=1e12).run(RUNS, [4, 2, 1], get, lambda run, answer: None)
    assert most[0] == 2 and names == {("kvfsm-mooncake-get", True)}


def test_shutting_the_lanes_down_does_not_wait_for_a_get_still_running() -> None:
    """A get hung on a dead store must not hold up the client's close (which bounds its own wait)."""
    gets, release = GetLanes(0.0), threading.Event()
    caller = threading.Thread(target=gets.run, args=([RUNS[0]], [4], lambda run: release.wait(WAIT_S),
                                                     lambda run, answer: None), daemon=True)
    caller.start()
    time.sleep(0.1)
    start = time.perf_counter()
    gets.shutdown()
    took = time.perf_counter() - start
    release.set()
    caller.join(WAIT_S)
    assert took < 1.0


def test_with_a_pace_the_next_get_is_issued_before_the_one_before_returns(lanes) -> None:
    """The first get returns only once the second started (or at the deadline): with a pace, the master round trip
    of the next get overlaps the transfer of the one before."""
    second = threading.Event()
    overlapped: list[bool] = []

    def get(run: range) -> int:
        if run.start == 0:
            overlapped.append(second.wait(WAIT_S))
        else:
            second.set()
        return 0

    lanes(lead_s=0.0, bytes_per_s=1e12).run(RUNS[:2], [4, 2], get, lambda run, answer: None)
    assert overlapped == [True], "the second get waited for the first to return"


def test_the_next_get_is_issued_lead_s_before_the_one_before_should_end(lanes) -> None:
    """At 10 bytes/s the first get of 4 bytes should end at 0.4 s; with a lead of 0.2 s the second is issued at about
    0.2 s, though the first holds 0.6 s: not at once, and not after the first returned."""
    recorder = Recorder(hold_s=0.6)
    lanes(lead_s=0.2, bytes_per_s=10.0).run(RUNS[:2], [4, 2], recorder.get, recorder.land)
    issued_after = recorder.started[4] - recorder.started[0]
    assert 0.15 <= issued_after < recorder.ended[0] - recorder.started[0] - 0.1, issued_after


def test_a_later_get_is_issued_after_the_expected_end_of_the_one_before_less_the_lead(lanes) -> None:
    """Expected ends add up. At 5 bytes/s the first get (4 bytes, held 0.8 s, which keeps the pace) should end at
    0.8 s, so the second is issued at 0.6 s and should end at 1.2 s, and the third is due at 1.0 s, on the lane the
    first left free at 0.8 s. Counted from the second's issue instead, it would be issued at 0.8 s; after the second
    returned, at 1.8 s."""
    recorder = Recorder(holds={0: 0.8, 4: 1.2, 6: 0.0})
    lanes(lead_s=0.2, bytes_per_s=5.0).run(RUNS, [4, 2, 1], recorder.get, recorder.land)
    assert 0.9 <= recorder.started[6] - recorder.started[0] < 1.5, recorder.started


def test_a_get_issued_when_the_one_before_already_returned_is_issued_at_once(lanes) -> None:
    """A pace that errs slow (1 byte/s: the first get should take 4 s) must not hold the next get once nothing is in
    flight."""
    recorder = Recorder()
    lanes(lead_s=0.0, bytes_per_s=1.0).run(RUNS[:2], [4, 2], recorder.get, recorder.land)
    assert recorder.started[4] - recorder.ended[0] < 1.0


def test_a_failed_get_stops_later_gets_and_is_raised_once_those_in_flight_returned(lanes) -> None:
    """At 10 bytes/s and a lead of 0.35 s the second get is due at 0.05 s and the third at 0.25 s; the first fails at
    0.1 s, while the second runs until 0.35 s."""
    recorder, in_flight_returned = Recorder(), threading.Event()

    def get(run: range) -> int:
        if run.start == 0:
            time.sleep(0.1)
            raise RuntimeError("the store failed")
        time.sleep(0.3)
        in_flight_returned.set()
        return recorder.get(run)

    with pytest.raises(RuntimeError, match="the store failed"):
        lanes(lead_s=0.35, bytes_per_s=10.0).run(RUNS, [4, 2, 1], get, recorder.land)
    assert in_flight_returned.is_set(), "raised while the second get still ran"
    assert 6 not in recorder.started, "a get was issued after one failed"


def test_a_failed_first_get_with_no_pace_issues_no_other() -> None:
    gets = GetLanes(0.0)
    issued: list[int] = []

    def get(run: range) -> int:
        issued.append(run.start)
        raise RuntimeError("the store failed")

    with pytest.raises(RuntimeError):
        gets.run(RUNS, [4, 2, 1], get, lambda run, answer: None)
    gets.shutdown()
    assert issued == [0] and gets.pace.bytes_per_s is None


def test_a_pace_is_learnt_only_from_a_get_that_moved_bytes_in_measurable_time() -> None:
    pace = GetPace()
    assert pace.seconds(100) is None
    pace.learn(0, 1.0)
    pace.learn(100, 0.0)
    assert pace.bytes_per_s is None
    pace.learn(1, 0.5)
    assert pace.bytes_per_s == 2.0
    pace.learn(100, 0.5)
    assert pace.bytes_per_s == 200.0 and pace.seconds(50) == 0.25
