"""`eager-every-tier`: with several eager tiers, every stored block is written back to each, one write-back at a
time (a slot has one write-back in flight). First the planner alone over two disk tiers (`Below`), then an engine
over a disk tier and a real Mooncake store both eager, as the soak that found the bug ran them; each with the
control `one-eager-queue` (the first tier's pick hides the block from the second), which the checks must catch."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import Harness
from kvfsm.testing.mooncake_store import shared_master
from kvfsm.testing.tier_mutants import MULTI_TIER_CONTROLS
from test_tier_planner import Below

PROMPT = tuple(range(3, 3 + 16))


@pytest.fixture
def two_disks(tmp_path: Path) -> Iterator[Below]:
    """The planner alone over two disk tiers, `near` and `far`, both eager."""
    b = Below(tmp_path, ("eager", "eager"), cpu_blocks=4, bound_blocks=4)
    yield b
    b.close()


def written_back(b: Below) -> dict[str, set[int]]:
    """Run write-backs to the end: the keys ordered written back to each tier."""
    ordered: dict[str, set[int]] = {name: set() for name in b.tiers}
    for _ in range(10):
        orders = b.orders()
        b.land()
        for kind, tier, keys in orders:
            if kind == "write-back":
                ordered[tier].update(keys)
    return ordered


def test_every_eager_tier_is_offered_every_stored_block(two_disks: Below) -> None:
    b = two_disks
    b.ready([1, 2])
    b.planner.stored([1, 2])
    assert written_back(b) == {"near": {1, 2}, "far": {1, 2}}


def test_a_block_another_tier_is_writing_back_waits_for_the_write_to_end_then_goes_to_the_next_tier(
        two_disks: Below) -> None:
    b = two_disks
    b.ready([1])
    b.planner.stored([1])
    assert b.orders() == [("write-back", "near", (1,))]
    assert b.orders() == [], "a second write-back reads a slot the first still reads"
    b.land()
    assert b.orders() == [("write-back", "far", (1,))]


def test_the_control_in_which_the_first_tiers_pick_hides_the_block_starves_the_second_tier(
        two_disks: Below) -> None:
    b = two_disks
    MULTI_TIER_CONTROLS["one-eager-queue"](b.planner)
    b.ready([1, 2])
    b.planner.stored([1, 2])
    assert written_back(b)["far"] == set()


@pytest.fixture
def disk_and_mooncake() -> Iterator[Callable[[], Harness]]:
    """Engines over a disk tier and a Mooncake tier (one shared real master), both eager."""
    master = shared_master()
    if master is None:
        pytest.skip("Mooncake is not installed")
    opened: list[Harness] = []

    def open_() -> Harness:
        opened.append(Harness(SimDevice(), num_gpu_blocks=12, cpu_blocks=8, disk_slots=16, mooncake_master=master,
                              writeback="eager", writeback_bound_blocks=2))
        return opened[-1]

    yield open_
    for each in opened:
        each.close()


def serve(h: Harness) -> list[str]:
    h.add_request(PROMPT, max_new_tokens=3)
    h.drain()
    return h.final_violations()


def test_disk_and_mooncake_both_eager_each_receive_every_stored_block(
        disk_and_mooncake: Callable[[], Harness]) -> None:
    h = disk_and_mooncake()
    assert serve(h) == []
    stats = h.connector.scheduler.tiers.stats  # type: ignore[union-attr]
    assert stats.blocks_written_back["disk"] == stats.blocks_written_back["mooncake"] > 0


def test_the_control_that_hides_the_first_tiers_pick_from_mooncake_is_caught(
        disk_and_mooncake: Callable[[], Harness]) -> None:
    h = disk_and_mooncake()
    MULTI_TIER_CONTROLS["one-eager-queue"](h.connector.scheduler.tiers)  # type: ignore[arg-type]
    assert any(line.startswith("eager-every-tier: mooncake:") for line in serve(h))
