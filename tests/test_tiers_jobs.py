"""The poll loop every tier shares (`TierJobs`), driven by hand: jobs whose calls answer when the test says, on a
clock that moves only when the test moves it, so each rule (deadline, answers, bugs, messages) is seen alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvfsm.machines import default_machines
from kvfsm.tier_records import TierEntry
from kvfsm.tiers.base import IoJob, IoKind, TierCompletion, TierFailure, TierJobs, TierMisuse
from kvfsm.tiers.entries import TierEntries

BLOCK_BYTES = 8
DEADLINE = 10.0


class Fault(OSError):
    """An error the test tier's I/O produces (its `reason` reads it as `io-error`)."""


@dataclass
class Calls:
    """A job's calls: no answers until the test gives them; each `poll` records the time it was asked at."""

    answers: list[object] | None = None
    deadline: float = DEADLINE
    asked_at: list[float] = field(default_factory=list)
    raises: BaseException | None = None

    def poll(self, now: float) -> Sequence[object] | None:
        self.asked_at.append(now)
        if self.raises is not None:
            raise self.raises
        return self.answers


@dataclass
class Tier:
    """A `TierJobs` with its entries, a clock the test sets, and every `settled` call it made."""

    now: float = 0.0
    settled: list[tuple[IoKind, TierEntry, TierFailure | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.entries = TierEntries("tier", default_machines())
        self.jobs = TierJobs("test tier", self.entries, BLOCK_BYTES,
                             reason=lambda error: TierFailure.io_error if isinstance(error, Fault) else None,
                             settled=lambda kind, entry, failure: self.settled.append((kind, entry, failure)),
                             clock=lambda: self.now)

    def write(self, job_id: int, keys: Sequence[int], calls: Calls) -> list[TierEntry]:
        entries = [self.entries.reserve(key) for key in keys]
        self.jobs.start(job_id, IoJob("write", entries, calls))  # type: ignore[arg-type]
        return entries  # type: ignore[return-value]

    def read(self, job_id: int, keys: Sequence[int], calls: Calls) -> list[TierEntry]:
        for key in keys:
            self.entries.adopt(key)
        entries = [self.entries.pin(key) for key in keys]
        self.jobs.start(job_id, IoJob("read", entries, calls))  # type: ignore[arg-type]
        return entries  # type: ignore[return-value]


def test_a_write_reports_no_checksums_and_tells_the_tier_each_entry_settled() -> None:
    tier = Tier()
    entries = tier.write(1, (5, 6), Calls(answers=[11, 12]))
    assert tier.jobs.poll() == [TierCompletion(1)]
    assert tier.settled == [("write", entries[1], None), ("write", entries[0], None)]


def test_a_read_reports_each_keys_checksum_none_included() -> None:
    tier = Tier()
    tier.read(1, (5, 6), Calls(answers=[11, None]))
    assert tier.jobs.poll() == [TierCompletion(1, checksums={5: 11, 6: None})]


def test_calls_are_polled_at_the_tiers_clock() -> None:
    tier = Tier(now=3.0)
    calls = Calls()
    tier.write(1, (5,), calls)
    tier.jobs.poll()
    assert calls.asked_at == [3.0]


def test_a_job_is_hung_once_its_clock_reaches_the_deadline_and_later_jobs_still_settle() -> None:
    tier = Tier(now=DEADLINE)
    tier.write(1, (5,), Calls())
    tier.write(2, (6,), Calls(answers=[12]))
    assert tier.jobs.poll() == [TierCompletion(1, {5: TierFailure.timeout}, held=True), TierCompletion(2)]


def test_a_hung_job_is_named_in_the_warning(caplog: pytest.LogCaptureFixture) -> None:
    tier = Tier(now=DEADLINE)
    tier.write(7, (5,), Calls())
    with caplog.at_level(logging.WARNING):
        tier.jobs.poll()
    assert "test tier: write job 7: still running past its deadline" in caplog.messages


def test_a_failed_key_is_named_in_the_warning_and_the_settled_call(caplog: pytest.LogCaptureFixture) -> None:
    tier = Tier()
    entries = tier.write(1, (0x5,), Calls(answers=[Fault("disk gone")]))
    with caplog.at_level(logging.WARNING):
        assert tier.jobs.poll() == [TierCompletion(1, {5: TierFailure.io_error})]
    assert "test tier: write of key 0x5: Fault: disk gone" in caplog.messages
    assert tier.settled == [("write", entries[0], TierFailure.io_error)]


def test_calls_that_raise_fail_every_key_of_the_job() -> None:
    tier = Tier()
    tier.read(1, (5, 6), Calls(raises=Fault("lost")))
    assert tier.jobs.poll() == [TierCompletion(1, {5: TierFailure.io_error, 6: TierFailure.io_error})]


def test_calls_answering_fewer_keys_than_the_job_holds_are_refused() -> None:
    tier = Tier()
    tier.write(1, (5, 6), Calls(answers=[11]))
    with pytest.raises(ValueError, match="zip"):
        tier.jobs.poll()


def test_several_errors_no_io_produces_are_raised_together() -> None:
    tier = Tier()
    bugs = [KeyError("a"), TypeError("b")]
    tier.write(1, (5, 6), Calls(answers=list(bugs)))
    with pytest.raises(ExceptionGroup, match="^test tier: errors no I/O produces") as raised:
        tier.jobs.poll()
    assert set(raised.value.exceptions) == set(bugs)


@pytest.mark.parametrize(("keys", "sizes", "message"), [
    ((5, 5), (BLOCK_BYTES, BLOCK_BYTES), "test tier: job 1 names 2 keys"),
    ((5,), (BLOCK_BYTES + 1,), r"test tier: blocks of \[9\] bytes, expected 8"),
])
def test_a_misused_job_is_refused_with_the_tiers_name(keys: tuple[int, ...], sizes: tuple[int, ...],
                                                       message: str) -> None:
    views = [memoryview(bytearray(size)) for size in sizes]
    with pytest.raises(TierMisuse, match=message):
        Tier().jobs.check(1, keys, views)
