"""`CompiledLifecycle.fire_many` is `fire` on each model in order: same states, counters, trace and refusals."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.bindings import default_registry
from kvfsm.machines import CompiledLifecycle, IllegalTrigger, default_machines
from kvfsm.records import CpuBlock

CPU = default_machines()["cpu-block"]
TRIGGERS = sorted(CPU.lifecycle.triggers)


class SkipsGuards(CompiledLifecycle):
    """Control: a batch that takes the first branch of each (state, trigger) without asking its guards."""

    def fire_many(self, models: Any, trigger: str, **context: Any) -> None:
        for model in models:
            branch = self.table[(model.state, trigger)][0]
            model.state = branch.dest
            for effect in branch.effects:
                effect(model, **context)


def walked_block(slot: int, walk: list[str]) -> CpuBlock:
    """A block moved from `free` by the legal triggers of `walk` (illegal ones skipped), as the runtime would."""
    block = CpuBlock(slot)
    for trigger in walk:
        try:
            CPU.fire(block, trigger, block_hash=slot, job_id=slot)
        except IllegalTrigger:
            pass
    return block


def snapshot(blocks: list[CpuBlock]) -> list[tuple]:
    return [(b.state, b.readers, b.block_hash, b.writer_job) for b in blocks]


def run(fire: Callable[[list[CpuBlock]], None], blocks: list[CpuBlock]) -> tuple:
    """Outcome of one batch: final fields, the trace the machine reported, and the refusal (type and message)."""
    trace: list[tuple] = []
    observer = lambda _lc, model, source, trigger, dest: trace.append((model.slot, source, trigger, dest))  # noqa: E731
    CPU.observers.append(observer)
    try:
        fire(blocks)
        refusal = None
    except IllegalTrigger as err:
        refusal = (type(err), str(err))
    finally:
        CPU.observers.remove(observer)
    return snapshot(blocks), trace, refusal


batches = st.lists(st.lists(st.sampled_from(TRIGGERS), max_size=8), min_size=1, max_size=8)


def check_equals_fire_each(machine: CompiledLifecycle, walks: list[list[str]], trigger: str) -> None:
    one_by_one = [walked_block(i, w) for i, w in enumerate(walks)]
    batched = [walked_block(i, w) for i, w in enumerate(walks)]

    def each(blocks: list[CpuBlock]) -> None:
        for block in blocks:
            CPU.fire(block, trigger, block_hash=99, job_id=7)

    expected = run(each, one_by_one)
    assert run(lambda blocks: machine.fire_many(blocks, trigger, block_hash=99, job_id=7), batched) == expected


@given(walks=batches, trigger=st.sampled_from(TRIGGERS))
def test_fire_many_equals_fire_on_each(walks: list[list[str]], trigger: str) -> None:
    check_equals_fire_each(CPU, walks, trigger)


def test_control_that_skips_guards_is_caught() -> None:
    control = SkipsGuards(CPU.lifecycle, default_registry())
    # One reader: `unpin` must make the block ready, but the first declared branch keeps it loading.
    walks = [["allocate", "submit", "store-done", "pin"]]
    with pytest.raises(AssertionError):
        check_equals_fire_each(control, walks, "unpin")

