"""How a fetch is cut into Mooncake calls (`kvfsm.mooncake.pipeline`): what each get carries."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.mooncake.pipeline import (
    CHECK_OVER_GET, HASH_THREADS_RANGE, default_hash_threads, fetch_runs, round_values,
)


@given(count=st.integers(1, 300), last=st.integers(1, 40), threads=st.integers(1, 16))
def test_fetch_runs_get_every_value_once_in_order_and_end_with_one_round(count: int, last: int,
                                                                        threads: int) -> None:
    runs = fetch_runs(count, last, threads)
    assert [i for run in runs for i in run] == list(range(count))
    assert len(runs[-1]) == min(count, last) or len(runs) == 1
    shrink = max(1, threads // CHECK_OVER_GET)
    for earlier, later in zip(runs, runs[1:]):
        assert len(earlier) < (shrink + 1) * len(later), "a run whose checks would outlast the next run's get"


def test_fast_mac_threads_leave_a_fetch_few_gets_where_slow_ones_keep_even_runs() -> None:
    assert [len(run) for run in fetch_runs(128, 8, 8)] == [72, 32, 16, 8]
    assert [len(run) for run in fetch_runs(32, 4, 2)] == [4] * 8


def test_a_get_carries_one_value_per_mac_thread_and_at_least_pipeline_bytes() -> None:
    assert round_values([2 << 20] * 32, 8, 8 << 20) == 8
    assert round_values([2 << 20] * 32, 2, 8 << 20) == 4
    assert round_values([64 << 10] * 32, 2, 1 << 20) == 16


def test_a_call_rounds_up_to_whole_values_and_carries_at_least_one() -> None:
    assert round_values([3, 3], 1, 4) == 2  # 4 bytes of 3-byte values: two of them, not one and a third
    assert round_values([8], 1, 8) == 1
    assert round_values([1], 1, 64) == 64  # one-byte values: pipeline_bytes of them


@pytest.mark.parametrize("cores, threads", [(1, 2), (6, 3), (7, 3), (12, 6), (32, 8), (128, 8)])
def test_the_default_mac_threads_are_half_the_cores_within_bounds(cores: int, threads: int) -> None:
    assert default_hash_threads(cores) == threads
    assert HASH_THREADS_RANGE[0] <= default_hash_threads() <= HASH_THREADS_RANGE[1]


def test_without_cores_given_the_mac_threads_follow_the_cores_this_process_may_run_on(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(10)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert default_hash_threads() == 5
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # where the platform cannot say: every core
    assert default_hash_threads() == 8


def test_a_remainder_shorter_than_the_shrunk_share_of_a_run_gets_a_run_of_its_own_at_a_whole_share() -> None:
    """The share is whole values: 4 values, a last run of 3 and runs shrinking by 2 leave 1 value, which is not
    shorter than 3 // 2 = 1, so it is a run of its own (in fractions of a value, 1 < 1.5 would have joined it)."""
    assert [len(run) for run in fetch_runs(4, 3, 2 * CHECK_OVER_GET)] == [1, 3]
