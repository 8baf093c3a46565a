"""Failed copies on demand: a worker's transfers wrapped so that a chosen store or load fails where a real one can.

A copy can fail at three points of a worker's step, and each leaves different work behind on the streams:
- `check`: the job is refused when it is checked (`store_chunks`, `load_segments`, `store_segments`), before
  anything of it is enqueued;
- `merge`: a step's checked jobs are refused when they are merged into one pipeline (`merge_chunks` for stores,
  `merge` for loads), failing every job of the pipeline, nothing enqueued;
- `copy`: part-way through sending the pipeline, after `after` of its chunks (stores) or layer segments (loads,
  per-layer stores) were enqueued: the copies already on the stream still run, so the failure may be reported,
  and the blocks it touched reused, only once they ran.
"""

from __future__ import annotations

from typing import Literal

from kvfsm.executor.transfer import TransferError

Direction = Literal["store", "load"]
Stage = Literal["check", "merge", "copy"]
STAGES: tuple[Stage, ...] = ("check", "merge", "copy")


class InjectedFault(TransferError):
    """A transfer failure the test asked for."""


class FailingCopies:
    """A checked pipeline (`Chunks` or `Segments`) whose enqueue of piece number `after` (counted in the order
    they are sent, the last piece if there are fewer) raises; the pieces before it are enqueued as usual."""

    def __init__(self, copies: object, after: int, pieces: int, direction: Direction) -> None:
        self._copies = copies
        self._fail_at = min(after, pieces - 1)
        self._sent = 0
        self._direction = direction

    def __getattr__(self, name: str) -> object:
        return getattr(self._copies, name)

    def enqueue(self, piece: int, label: str) -> None:
        if self._sent == self._fail_at:
            self._fail_at = -1
            raise InjectedFault(f"injected {self._direction} failure after {self._sent} enqueued copies ({label})")
        self._sent += 1
        self._copies.enqueue(piece, label)  # type: ignore[attr-defined]


class FaultInjector:
    """Wraps a worker's transfers; once armed (`arm`), the next store or load of that direction fails at the
    chosen stage, as a real failure would there."""

    def __init__(self, transfers: object) -> None:
        self._transfers = transfers
        self.armed: Direction | None = None
        self.stage: Stage = "check"
        self.after = 0
        self.every = False

    def arm(self, direction: Direction | None, stage: Stage = "check", after: int = 0, every: bool = False) -> None:
        """Fail the next `direction` job at `stage` (every such job, with `every`; None disarms)."""
        self.armed, self.stage, self.after, self.every = direction, stage, after, every

    def __getattr__(self, name: str) -> object:
        return getattr(self._transfers, name)

    def _strikes(self, direction: Direction, stage: Stage) -> bool:
        if self.armed != direction or self.stage != stage:
            return False
        if not self.every:
            self.armed = None
        return True

    def _maybe_fail(self, direction: Direction, stage: Stage) -> None:
        if self._strikes(direction, stage):
            raise InjectedFault(f"injected {direction} failure at {stage}")

    def _pipeline(self, direction: Direction, copies: object) -> object:
        if not self._strikes(direction, "copy"):
            return copies
        pieces = getattr(copies, "count", None) or self._transfers.num_segments  # type: ignore[attr-defined]
        return FailingCopies(copies, self.after, pieces, direction)

    def store_chunks(self, *args: object, **kwargs: object) -> object:
        self._maybe_fail("store", "check")
        return self._transfers.store_chunks(*args, **kwargs)  # type: ignore[attr-defined]

    def merge_chunks(self, *args: object, **kwargs: object) -> object:
        self._maybe_fail("store", "merge")
        return self._pipeline("store", self._transfers.merge_chunks(*args, **kwargs))  # type: ignore[attr-defined]

    def load_segments(self, *args: object, **kwargs: object) -> object:
        self._maybe_fail("load", "check")
        return self._transfers.load_segments(*args, **kwargs)  # type: ignore[attr-defined]

    def merge(self, *args: object, **kwargs: object) -> object:
        self._maybe_fail("load", "merge")
        return self._pipeline("load", self._transfers.merge(*args, **kwargs))  # type: ignore[attr-defined]

    def store_segments(self, *args: object, **kwargs: object) -> object:
        """A per-layer store is never merged: a `copy` fault strikes its layer segments."""
        self._maybe_fail("store", "check")
        return self._pipeline("store", self._transfers.store_segments(*args, **kwargs))  # type: ignore[attr-defined]


class EveryNthFails(FaultInjector):
    """Every `n`-th store or load a worker checks fails: one rank's copies failing while the others' succeed."""

    def __init__(self, transfers: object, n: int) -> None:
        super().__init__(transfers)
        self.n = n
        self.submitted = 0

    def _maybe_fail(self, direction: Direction, stage: Stage) -> None:
        if stage != "check":
            return
        self.submitted += 1
        if self.submitted % self.n == 0:
            raise InjectedFault(f"injected failure of {direction} #{self.submitted}")
