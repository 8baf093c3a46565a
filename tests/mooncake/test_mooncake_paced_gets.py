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


def test_with_no_pace_each_get_waits_for_the_one_before_and_the_first_teaches_the_pace(lanes) -> None:
    recorder, gets = Recorder(hold_s=0.05), lanes(lead_s=1.0)
    gets.run(RUNS, [4 << 20, 2 << 20, 1 << 20], recorder.get, recorder.land)
    assert recorder.started[4] >= recorder.ended[0], "the second get started before the first returned"
    assert gets.pace.bytes_per_s is not None and gets.pace.bytes_per_s <= (4 << 20) / 0.05
    assert gets.pace.bytes_per_s > (4 << 20) / WAIT_S


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
    pace.learn(100, 0.5)
    assert pace.bytes_per_s == 200.0 and pace.seconds(50) == 0.25
