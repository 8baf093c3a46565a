"""A tier's production I/O executor: exactly its configured count of threads, named after the tier (what a thread
dump of a hung disk shows)."""

from __future__ import annotations

import threading

from kvfsm.tiers.io import ManualIo, io_threads


def test_a_tiers_io_runs_on_its_count_of_threads_named_after_it() -> None:
    pool = io_threads(1, "disk")
    release, second_started = threading.Event(), threading.Event()
    try:
        first = pool.submit(lambda: release.wait(5.0) and threading.current_thread().name)
        second = pool.submit(lambda: second_started.set() or threading.current_thread().name)
        assert not second_started.wait(0.1), "a second operation ran beside the first on a one-thread tier"
        release.set()
        assert first.result(5.0) == second.result(5.0) and first.result().startswith("kvfsm-disk-io")
    finally:
        release.set()
        pool.shutdown(wait=True)


def test_manual_io_numbers_each_submission_from_0_and_drops_the_number_of_one_run() -> None:
    io = ManualIo()
    for _ in range(3):
        io.submit(lambda: None)
    io.run_one(1)
    assert io.numbers == [0, 2]


def test_manual_io_runs_what_is_queued_when_shut_down() -> None:
    io = ManualIo()
    done = io.submit(lambda: "ran")
    io.shutdown()
    assert done.result(0) == "ran"
