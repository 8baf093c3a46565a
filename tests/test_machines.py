"""The compiled table and the transitions-library machine agree on every (state, trigger, guard outcome)."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.machines import CompiledLifecycle, GuardRefused, IllegalTrigger, MachineSet, TransitionsLifecycle
from kvfsm.records import CpuBlock, GpuBlock
from kvfsm.bindings import default_spec
from kvfsm.spec import Spec
from kvfsm.testing.coverage import Probe, probe_registry


@cache
def probe_machines() -> tuple[Spec, dict[str, CompiledLifecycle], dict[str, TransitionsLifecycle]]:
    spec = default_spec()
    registry = probe_registry(spec)
    table = {name: CompiledLifecycle(lc, registry) for name, lc in spec.lifecycles.items()}
    reference = {name: TransitionsLifecycle(lc, registry) for name, lc in spec.lifecycles.items()}
    return spec, table, reference


@st.composite
def probes(draw: st.DrawFn) -> tuple[str, str, str, dict[str, bool]]:
    spec, _, _ = probe_machines()
    name = draw(st.sampled_from(sorted(spec.lifecycles)))
    lc = spec[name]
    state = draw(st.sampled_from(sorted(lc.states)))
    trigger = draw(st.sampled_from([*lc.triggers, "no-such-trigger"]))
    guard_names = sorted({g for t in lc.transitions for g in t.guards})
    values = {g: draw(st.booleans()) for g in guard_names}
    return name, state, trigger, values


def outcome(machine: object, state: str, trigger: str, values: dict[str, bool]) -> tuple:
    probe = Probe(state, values)
    try:
        dest = machine.fire(probe, trigger)  # type: ignore[attr-defined]
    except GuardRefused:
        return ("refused-by-guard", probe.state, tuple(probe.effects))
    except IllegalTrigger:
        return ("illegal", probe.state, tuple(probe.effects))
    assert dest == probe.state
    return ("moved", probe.state, tuple(probe.effects))


@given(probes())
def test_table_and_transitions_machine_agree(case: tuple[str, str, str, dict[str, bool]]) -> None:
    name, state, trigger, values = case
    _, table, reference = probe_machines()
    assert outcome(table[name], state, trigger, values) == outcome(reference[name], state, trigger, values)


def test_every_state_trigger_pair_agrees_exhaustively() -> None:
    spec, table, reference = probe_machines()
    for name, lc in spec.lifecycles.items():
        guard_names = sorted({g for t in lc.transitions for g in t.guards})
        for state in lc.states:
            for trigger in lc.triggers:
                for bits in range(2 ** len(guard_names)):
                    values = {g: bool(bits >> i & 1) for i, g in enumerate(guard_names)}
                    assert outcome(table[name], state, trigger, values) == outcome(
                        reference[name], state, trigger, values
                    ), (name, state, trigger, values)


@pytest.mark.parametrize("backend", ["table", "transitions"])
def test_illegal_trigger_names_lifecycle_state_and_trigger(backend: str) -> None:
    machines = MachineSet(default_spec(), backend=backend)  # type: ignore[arg-type]
    block = CpuBlock(slot=0)
    with pytest.raises(IllegalTrigger, match="lifecycle 'cpu-block': trigger 'evict' is illegal in state 'free'"):
        machines["cpu-block"].fire(block, "evict")
    assert block.state == "free"


@pytest.mark.parametrize("backend", ["table", "transitions"])
def test_refused_guard_raises_and_leaves_the_model_unchanged(backend: str) -> None:
    machines = MachineSet(default_spec(), backend=backend)  # type: ignore[arg-type]
    block = GpuBlock(block_id=0, state="fenced", store_readers=0)  # a count no legal path produces
    with pytest.raises(GuardRefused, match=r"^lifecycle 'gpu-block': trigger 'unfence' is illegal in state 'fenced' "
                                           r"\(no guard holds") as refused:
        machines["gpu-block"].fire(block, "unfence")
    assert (refused.value.lifecycle, refused.value.state, refused.value.trigger) == ("gpu-block", "fenced", "unfence")
    assert (block.state, block.store_readers) == ("fenced", 0)


@pytest.mark.parametrize("backend", ["table", "transitions"])
def test_a_trigger_the_spec_lacks_is_refused_naming_lifecycle_state_and_trigger(backend: str) -> None:
    machines = MachineSet(default_spec(), backend=backend)  # type: ignore[arg-type]
    block = CpuBlock(slot=0)
    with pytest.raises(IllegalTrigger, match="^lifecycle 'cpu-block': trigger 'no-such-trigger' is illegal in "
                                             "state 'free'$") as refused:
        machines["cpu-block"].fire(block, "no-such-trigger")
    assert (refused.value.lifecycle, refused.value.state, refused.value.trigger) == (
        "cpu-block", "free", "no-such-trigger")
    assert block.state == "free"


@pytest.mark.parametrize("backend", ["table", "transitions"])
def test_a_machine_takes_only_the_spec_triggers_not_the_library_automatic_moves(backend: str) -> None:
    """transitions can add a `to_<state>` trigger for every state; a lifecycle must not gain moves the spec lacks."""
    machines = MachineSet(default_spec(), backend=backend)  # type: ignore[arg-type]
    block = CpuBlock(slot=0)
    with pytest.raises(IllegalTrigger):
        machines["cpu-block"].fire(block, "to_ready")
    assert block.state == "free"


def test_a_compiled_guard_refusal_lists_the_guards_of_every_branch_word_for_word() -> None:
    _, table, _ = probe_machines()
    with pytest.raises(GuardRefused) as refused:
        table["transfer-job"].fire(Probe("submitted"), "complete")
    assert str(refused.value) == (
        "lifecycle 'transfer-job': trigger 'complete' is illegal in state 'submitted' "
        "(no guard holds: is-store+all-segments-landed / is-load+all-segments-landed)")


@pytest.mark.parametrize(("backend", "machine_type"), [(None, CompiledLifecycle), ("table", CompiledLifecycle),
                                                        ("transitions", TransitionsLifecycle)])
def test_a_machine_set_builds_every_lifecycle_on_its_backend_the_compiled_table_by_default(
        backend: str | None, machine_type: type) -> None:
    spec = default_spec()
    machines = MachineSet(spec) if backend is None else MachineSet(spec, backend=backend)  # type: ignore[arg-type]
    assert machines.backend == (backend or "table")
    assert {type(machine) for machine in machines} == {machine_type}
    assert len(machines.machines) == len(spec.lifecycles)


def test_a_refusal_names_its_detail_in_parentheses_and_only_when_there_is_one() -> None:
    assert str(IllegalTrigger("cpu-block", "free", "evict")) == (
        "lifecycle 'cpu-block': trigger 'evict' is illegal in state 'free'")
    assert str(IllegalTrigger("cpu-block", "free", "evict", "why")).endswith("'free' (why)")


@pytest.mark.parametrize("backend", ["table", "transitions"])
def test_effects_keep_reader_count_and_state_together(backend: str) -> None:
    blocks = MachineSet(default_spec(), backend=backend)["cpu-block"]  # type: ignore[arg-type]
    block = CpuBlock(slot=3)
    for trigger in ("allocate", "submit", "store-done", "pin"):
        blocks.fire(block, trigger, block_hash=0xAB)
    assert (block.state, block.readers, block.block_hash) == ("loading", 1, 0xAB)
    blocks.fire(block, "unpin")
    assert (block.state, block.readers) == ("ready", 0)


@pytest.mark.parametrize("backend", ["table", "transitions"])
def test_a_loading_block_cannot_be_pinned_by_a_second_load(backend: str) -> None:
    blocks = MachineSet(default_spec(), backend=backend)["cpu-block"]  # type: ignore[arg-type]
    block = CpuBlock(slot=0)
    for trigger in ("allocate", "submit", "store-done", "pin"):
        blocks.fire(block, trigger, block_hash=1)
    with pytest.raises(IllegalTrigger, match="'pin' is illegal in state 'loading'"):
        blocks.fire(block, "pin")
    assert block.readers == 1


def test_observers_see_every_transition() -> None:
    machines = MachineSet(default_spec())
    trace: list[tuple[str, str, str, str]] = []
    machines.observe(lambda lc, model, src, trig, dest: trace.append((lc, src, trig, dest)))
    machines["cpu-block"].fire(CpuBlock(slot=0), "allocate", block_hash=1)
    assert trace == [("cpu-block", "free", "allocate", "pending-store")]
