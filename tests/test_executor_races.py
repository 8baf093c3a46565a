"""The GPU ordering rules, checked over every schedule SimDevice can produce.

Each scenario is built twice: as kvfsm's connector issues it (with the event wait the rule asks for) and as a
control without that wait. Every interleaving of the three streams is enumerated. With the wait, every schedule
moves the right bytes and the invariant is silent; without it, some schedule moves the wrong bytes, and the
invariant reports exactly the schedules that did.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from kvfsm.executor import HostPool, KVCaches, SimDevice, StreamName, Touch, Transfers, register_kv_caches
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.access import Access
from kvfsm.invariants import (
    check_all, layer_store_after_compute, layer_stores_flushed, load_after_readers, load_before_use,
    store_after_compute,
)

Outcome = tuple[bool, list[str]]  # (bytes correct, invariant violations)
Scenario = Callable[[bool], tuple[SimDevice, Callable[[], Outcome]]]


def rig() -> tuple[SimDevice, KVCaches, HostPool, Transfers]:
    device = SimDevice()
    tensors, groups = allocate_kv_caches("kv-first", 2, 4, 2, 1, 4, torch.float16, "cpu")
    for i, t in enumerate(tensors.values()):
        t.view(torch.uint8).view(-1).copy_(torch.arange(t.numel() * 2).add(i).remainder(251))
    caches = register_kv_caches(tensors, "kv-first", groups)
    pool = HostPool(device, 2, caches.gpu_block_bytes)
    return device, caches, pool, Transfers(device, caches, pool, 1)


def block(caches: KVCaches, b: int) -> torch.Tensor:
    return torch.cat([plane.rows[p, b] for plane in caches.planes for p in range(plane.pieces)])


def fill_block(caches: KVCaches, b: int, value: int) -> None:
    for plane in caches.planes:
        plane.rows[:, b].fill_(value)


def bystander(device: SimDevice, stream: StreamName) -> None:
    """Unrelated work (a read of block 0) on a stream the scenario leaves free, so even the ordered scenarios have
    several schedules."""
    device.enqueue(stream, stream, f"{stream} bystander", lambda: None, [Touch("read", "gpu", (0,))])


def world(device: SimDevice) -> SimpleNamespace:
    return SimpleNamespace(accesses=device.accesses)


def store_after_compute_scenario(wait: bool) -> tuple[SimDevice, Callable[[], Outcome]]:
    """Compute writes block 1, then a store copies block 1 to slot 0."""
    device, caches, pool, transfers = rig()
    computed = device.new_event()
    device.enqueue("compute", "compute", "compute step 1", lambda: fill_block(caches, 1, 0x11),
                   [Touch("write", "gpu", (1,))])
    device.record("compute", computed)
    if wait:
        device.wait("store", computed)
    transfers.store([1], [0], label="store job 1")
    bystander(device, "compute")
    return device, lambda: (bool((pool.slot(0) == 0x11).all()), store_after_compute(world(device)))


def load_after_store_reader_scenario(wait: bool) -> tuple[SimDevice, Callable[[], Outcome]]:
    """A store copies block 2 out, then a load overwrites block 2 from slot 1."""
    device, caches, pool, transfers = rig()
    original = block(caches, 2).clone()
    pool.slot(1).fill_(0x22)
    transfers.store([2], [0], label="store job 1")
    stored = device.new_event()
    device.record("store", stored)
    if wait:
        device.wait("load", stored)
    transfers.load([1], [2], label="load job 2")
    bystander(device, "compute")
    return device, lambda: (torch.equal(pool.slot(0), original), load_after_readers(world(device)))


def load_after_compute_reader_scenario(wait: bool) -> tuple[SimDevice, Callable[[], Outcome]]:
    """Compute reads block 2, then a load overwrites block 2 from slot 1."""
    device, caches, pool, transfers = rig()
    original = block(caches, 2).clone()
    seen: list[torch.Tensor] = []
    pool.slot(1).fill_(0x22)
    device.enqueue("compute", "compute", "compute step 1", lambda: seen.append(block(caches, 2).clone()),
                   [Touch("read", "gpu", (2,))])
    read = device.new_event()
    device.record("compute", read)
    if wait:
        device.wait("load", read)
    transfers.load([1], [2], label="load job 2")
    bystander(device, "compute")
    return device, lambda: (torch.equal(seen[0], original), load_after_readers(world(device)))


def load_before_use_scenario(wait: bool) -> tuple[SimDevice, Callable[[], Outcome]]:
    """A load fills block 3 from slot 1, then compute reads block 3."""
    device, caches, pool, transfers = rig()
    seen: list[torch.Tensor] = []
    pool.slot(1).fill_(0x33)
    transfers.load([1], [3], label="load job 1")
    loaded = device.new_event()
    device.record("load", loaded)
    if wait:
        device.wait("compute", loaded)
    device.enqueue("compute", "compute", "compute step 2", lambda: seen.append(block(caches, 3).clone()),
                   [Touch("read", "gpu", (3,))])
    bystander(device, "store")
    return device, lambda: (bool((seen[0] == 0x33).all()), load_before_use(world(device)))


def every_schedule(scenario: Scenario, wait: bool) -> list[Outcome]:
    """Run the scenario once per interleaving of its streams (depth-first over the choice at each step)."""
    outcomes, pending = [], [[]]
    while pending:
        prefix = pending.pop()
        device, check = scenario(wait)
        path: list[str] = []
        while not device.idle:
            options = device.runnable()
            if len(path) < len(prefix):
                pick = prefix[len(path)]
            else:
                pick = options[0]
                pending.extend(path + [alt] for alt in options[1:])
            path.append(pick)
            device.run_one(pick)
        outcomes.append(check())
    return outcomes


SCENARIOS = {
    "store-after-compute": store_after_compute_scenario,
    "load-after-readers (store reader)": load_after_store_reader_scenario,
    "load-after-readers (compute reader)": load_after_compute_reader_scenario,
    "load-before-use": load_before_use_scenario,
}


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_with_the_wait_every_schedule_moves_the_right_bytes(scenario: Scenario) -> None:
    outcomes = every_schedule(scenario, wait=True)
    assert len(outcomes) > 1
    assert all(correct and not violations for correct, violations in outcomes)


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_control_without_the_wait_has_a_corrupting_schedule_the_invariant_reports(scenario: Scenario) -> None:
    outcomes = every_schedule(scenario, wait=False)
    assert any(not correct for correct, _ in outcomes)
    assert all(correct == (not violations) for correct, violations in outcomes)


# --- which accesses conflict ---------------------------------------------------------------------------------

def access(issued: int, executed: int, actor: str, mode: str, layer: int | None) -> Access:
    return Access(issued, executed, actor, mode, "gpu", 3, f"{actor} {issued}", layer)  # type: ignore[arg-type]


def accesses(*found: Access) -> SimpleNamespace:
    return SimpleNamespace(accesses=list(found))


def test_a_whole_block_access_conflicts_with_each_layer_of_the_block_whichever_was_issued_first() -> None:
    whole_write_then_layer_read = accesses(access(0, 1, "compute", "write", None), access(1, 0, "store", "read", 1))
    layer_read_then_whole_write = accesses(access(0, 1, "store", "read", 1), access(1, 0, "compute", "write", None))
    other_layers = accesses(access(0, 1, "store", "read", 1), access(1, 0, "compute", "write", 0))
    assert layer_store_after_compute(whole_write_then_layer_read) == [  # type: ignore[arg-type]
        "gpu block 3 layer 1: store 1 (read) ran before compute 0 (write), which was issued first"]
    assert layer_stores_flushed(layer_read_then_whole_write) == [  # type: ignore[arg-type]
        "gpu block 3 layer 1: compute 1 (write) ran before store 0 (read), which was issued first"]
    assert not layer_stores_flushed(other_layers)  # type: ignore[arg-type]


def test_check_all_runs_only_the_invariants_it_is_named() -> None:
    """A world that has only an access log can be checked by the ordering invariants alone."""
    world = accesses(access(0, 1, "compute", "write", None), access(1, 0, "store", "read", None))
    assert check_all(world, ["store-after-compute"]) == {"store-after-compute": [  # type: ignore[arg-type]
        "gpu block 3: store 1 (read) ran before compute 0 (write), which was issued first"]}
