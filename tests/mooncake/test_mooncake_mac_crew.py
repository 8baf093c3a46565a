"""A call's MAC crew: values handed over are each worked once, and a caller that joins the crew works through what
is still queued itself rather than only waiting for MAC threads to wake (`kvfsm.mooncake.mac_crew`)."""

from __future__ import annotations

import threading
import time

from kvfsm.mooncake.mac_crew import MacThreads

WAIT_S = 10.0


def test_joining_a_crew_works_through_its_queued_values_on_the_joining_thread() -> None:
    threads = MacThreads(1)
    release = threading.Event()
    threads.submit(release.wait)  # the crew's only MAC thread is busy: the joining thread alone can work
    worked: dict[int, int] = {}

    def work(index: int) -> tuple[int, int]:
        worked[index] = threading.get_ident()
        return threading.get_ident(), index * index

    crew = threads.crew(work)
    crew.hand(range(5))
    answers: dict[int, tuple[int, int]] = {}
    joiner = threading.Thread(target=lambda: answers.update(crew.join()), daemon=True)
    joiner.start()
    deadline = time.monotonic() + WAIT_S
    while len(worked) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    joiner.join(WAIT_S)
    threads.shutdown()
    assert answers == {i: (joiner.ident, i * i) for i in range(5)}, "the joining thread left queued values waiting"


def test_a_joined_crew_answers_every_value_handed_over_once_whichever_thread_worked_it() -> None:
    threads = MacThreads(3)
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def work(index: int) -> int:
        with lock:
            counts[index] = counts.get(index, 0) + 1
        return -index

    with threads.crew(work) as crew:
        crew.hand(range(100))
        answers = crew.join()
    threads.shutdown()
    assert answers == {i: -i for i in range(100)}
    assert set(counts.values()) == {1}, "a value was worked more than once"
