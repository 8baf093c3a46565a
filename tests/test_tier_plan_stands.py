"""A write-back plan that ordered nothing stands until something it read changed (`TierPlanner._plan_stands`).

An on-evict tier's plan reads the pool's next victims (its blocks' states and its eviction order), the tier's index
(which of them it holds already) and the bytes in flight; an idle step that re-read them all found the same nothing.
The pool and each tier count their changes (`OffloadingManager.version`, `LowerTier.plan_version`), and a plan is
made again only once a count moved. The rule: after any change, the planner orders exactly what a fresh plan would,
and counts the same plans held back at the byte bound. Each test runs two planners side by side over equal pools and
tiers (`Twins`), one keeping its standing plan and one planning afresh every step, and compares every step's orders;
each control of `PLAN_CONTROLS` leaves one kind of change uncounted and is caught."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Callable, Iterator

import pytest
from hypothesis import given, strategies as st

from kvfsm.connector.tier_planner import TierPlanner
from kvfsm.testing.tier_mutants import PLAN_CONTROLS

from test_tier_planner import Below

Action = Callable[[Below], None]


class Twins:
    """Two planners over equal pools and on-evict disk tiers, given the same calls: `kept` keeps a plan that stands,
    `fresh` forgets it before every step."""

    def __init__(self, path: Path, bound_blocks: int = 4, control: Callable[[TierPlanner], None] | None = None) -> None:
        self.kept = Below(path / "kept", ("on-evict",), cpu_blocks=4, bound_blocks=bound_blocks)
        self.fresh = Below(path / "fresh", ("on-evict",), cpu_blocks=4, bound_blocks=bound_blocks)
        if control is not None:
            control(self.kept.planner)
        self.stood = 0
        """Steps at which the kept planner's plan stood (it made none)."""
        plan = self.kept.planner._plan_write_backs

        def counted(step: int) -> int:
            self.stood -= 1
            return plan(step)

        self.kept.planner._plan_write_backs = counted  # type: ignore[method-assign]

    def both(self, action: Action) -> None:
        action(self.kept)
        action(self.fresh)

    def step(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """One step's orders from both, which must be the same, as must the plans held back so far."""
        self.fresh.planner._standing = None
        self.stood += 1
        kept, fresh = self.kept.orders(), self.fresh.orders()
        assert kept == fresh
        assert self.kept.planner.stats.writebacks_held == self.fresh.planner.stats.writebacks_held
        return kept

    def close(self) -> None:
        self.kept.close()
        self.fresh.close()


@pytest.fixture
def twins(tmp_path: Path) -> Iterator[Callable[..., Twins]]:
    made: list[Twins] = []

    def make(bound_blocks: int = 4, control: Callable[[TierPlanner], None] | None = None) -> Twins:
        made.append(Twins(tmp_path / str(len(made)), bound_blocks, control))
        return made[-1]

    yield make
    for each in made:
        each.close()


def _fail_write(b: Below) -> None:
    """The oldest write in flight fails with an I/O error, then every job landed is reported."""
    if b.io.queue:
        future, _ = b.io.queue.pop(0)
        b.io.numbers.pop(0)
        future.set_exception(OSError(errno.EIO, "injected"))
    b.land()


def _written_back(t: Twins) -> None:
    """Four blocks in the pool; the policy's next two victims (4, 3) written back; the next plan orders nothing, and
    stands the step after."""
    t.both(lambda b: b.ready([1, 2, 3, 4]))
    while t.step():
        t.both(Below.land)
    assert t.step() == [] and t.stood == 1


def _given_up(t: Twins) -> None:
    """The same two victims' write-backs (one block's bytes in flight at most) failed: the plan leaves them out."""
    t.both(lambda b: b.ready([1, 2, 3, 4]))
    assert t.step() == [("write-back", "near", (4,))]
    t.both(_fail_write)
    assert t.step() == [("write-back", "near", (3,))]
    t.both(_fail_write)
    assert t.step() == []
    assert t.step() == [] and t.stood == 1


CHANGES: dict[str, tuple[Callable[[Twins], None], Action, str]] = {
    "a hit reorders the victims": (_written_back, lambda b: b.manager.touch([3, 4]), "touch-uncounted"),
    "a store evicts a victim": (_written_back, lambda b: b.ready([5]), "pool-moves-uncounted"),
    "the tier drops a victim's key": (_written_back, lambda b: b.tiers["near"].discard([3]), "tier-moves-uncounted"),
    "a reset forgets the keys given up on": (_given_up, lambda b: b.planner.reset(), "reset-keeps-plan"),
}
"""Each change a plan reads: the state it follows, the change, and the control that leaves it uncounted."""


@pytest.mark.parametrize("change", CHANGES)
def test_a_plan_after_a_change_is_the_fresh_plan(twins: Callable[..., Twins], change: str) -> None:
    before, apply, _ = CHANGES[change]
    t = twins(bound_blocks=1)
    before(t)
    t.both(apply)
    assert t.step() != []


@pytest.mark.parametrize("change", CHANGES)
def test_a_control_that_leaves_the_change_uncounted_is_caught(twins: Callable[..., Twins], change: str) -> None:
    before, apply, control = CHANGES[change]
    t = twins(bound_blocks=1, control=PLAN_CONTROLS[control])
    before(t)
    t.both(apply)
    with pytest.raises(AssertionError):
        t.step()


def test_two_hits_in_a_row_are_each_counted_and_the_plan_after_the_second_is_the_fresh_plan(
        twins: Callable[..., Twins]) -> None:
    """The first hit refreshes blocks that are not victims (the plan after it orders nothing, and stands); the
    second moves the victims the tier holds ahead of them, so the next victim is one the tier does not hold."""
    t = twins(bound_blocks=1)
    _written_back(t)
    t.both(lambda b: b.manager.touch([1, 2]))
    assert t.step() == []
    t.both(lambda b: b.manager.touch([3, 4]))
    assert t.step() == [("write-back", "near", (2,))]

def test_hits_and_a_store_between_two_plans_never_bring_the_pools_count_back_to_the_standing_plans(
        twins: Callable[..., Twins]) -> None:
    """The pool's count only moves on: four hits (a reorder each) and a store into the full pool (four transitions:
    eviction, claim, submission, completion) are all counted, whichever way each counts, so the plan after them is
    the fresh plan, which writes a block back the tier does not hold."""
    t = twins(bound_blocks=1)
    _written_back(t)
    for _ in range(4):
        t.both(lambda b: b.manager.touch([1, 2]))
    t.both(ACTIONS["ready"])
    assert t.step() != []

def test_a_plan_held_at_the_byte_bound_stands_and_is_counted_held_each_step(twins: Callable[..., Twins]) -> None:
    """One block's bytes in flight at most: the second victim waits, held back, every step until the first landed."""
    t = twins(bound_blocks=1)
    t.both(lambda b: b.ready([1, 2, 3, 4]))
    assert t.step() == [("write-back", "near", (4,))]
    t.step()
    t.step()
    assert t.stood == 1 and t.kept.planner.stats.writebacks_held == 3
    t.both(Below.land)
    assert t.step() == [("write-back", "near", (3,))]


def _ready_if_room(keys: list[int]) -> Action:
    """Store `keys` into the pool, ready, if it has room for them now (the write-backs in flight pin their slots)."""

    def store(b: Below) -> None:
        plan = b.manager.prepare_store(keys, next(b._jobs))
        if plan is not None:
            b.manager.mark_submitted(plan.slots)
            b.manager.complete_store(plan.slots, True)

    return store


ACTIONS: dict[str, Action] = {
    "ready": _ready_if_room([5, 6]),
    "ready-again": _ready_if_room([7]),
    "touch": lambda b: b.manager.touch([1, 2]),
    "touch-tail": lambda b: b.manager.touch([3, 4]),
    "publish": lambda b: b.publish("near", [2]),
    "drop": lambda b: b.tiers["near"].discard([1, 2, 3, 4]),
    "land": Below.land,
    "fail": _fail_write,
    "reset": lambda b: b.planner.reset(),
}


@given(st.integers(1, 3), st.lists(st.sampled_from(sorted(ACTIONS)), max_size=12))
def test_after_any_sequence_of_changes_the_kept_plan_is_the_fresh_plan(tmp_path_factory: pytest.TempPathFactory,
                                                                       bound: int, actions: list[str]) -> None:
    t = Twins(tmp_path_factory.mktemp("twins"), bound_blocks=bound)
    try:
        t.both(lambda b: b.ready([1, 2, 3, 4]))
        t.step()
        t.both(Below.land)
        for action in actions:
            t.step()
            t.step()
            t.both(ACTIONS[action])
        t.step()
    finally:
        t.close()
