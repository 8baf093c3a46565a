"""A hybrid cache through kvfsm's public API on the simulator: a full-attention group, a sliding window and a state
(`kvfsm.testing.hybrid_rig`), each group offloaded on its own terms as the vLLM adapter maps them.

The round trip stores every full-attention block but only the window at the prompt's end and the state's block, and
reloads exactly those into poisoned blocks, byte for byte. The reuse race (`kvfsm.testing.hybrid_race`): blocks the
writer's window leaves behind while its stores still copy them are handed at once to another request, whose writes
go on the compute stream right after; with the store stream lagging (the simulator's schedule) kvfsm keeps every
reloaded byte and every rule, and each control that removes the window's fence corrupts the window and the state
and is named by its rule. The same trials run on a GPU in tests/test_gpu_hybrid.py.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvfsm.checking.integration import fence_in_tables
from kvfsm.connector.tracked_ids import TrackedIdClash
from kvfsm.executor import SimDevice
from kvfsm.testing.hybrid_race import CAUGHT_BY, CONTROLS, SIM, app, trial, trials
from kvfsm.testing.hybrid_rig import HybridRig

PROMPT, WINDOW = SIM.prompt_blocks, SIM.shape.window_blocks


def test_a_hybrid_cache_round_trips_only_each_groups_window_byte_exact() -> None:
    (run,) = trials("sim", SIM, 1, reuse=False)
    assert run.stored == run.loaded == {"full": PROMPT, "window": WINDOW, "state": 1}
    assert run.corrupted == {"full": 0, "window": 0, "state": 0}
    assert run.broken == ()
    assert run.null_intact, "the null block was written"


def test_kvfsm_fences_every_block_the_window_leaves_behind_before_it_is_written() -> None:
    runs = trials("sim", SIM, 2)
    assert all(run.reused == WINDOW + 1 for run in runs), "the window's and the state's blocks were not handed out"
    assert [(run.corrupted, run.broken) for run in runs] == [({"full": 0, "window": 0, "state": 0}, ())] * 2


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_control_without_the_window_fence_corrupts_the_window_and_is_caught(control: str) -> None:
    (run,) = trials("sim", SIM, 1, control)
    assert run.corrupted == {"full": 0, "window": WINDOW, "state": 1}
    assert CAUGHT_BY[control] in run.broken


def test_fence_on_the_engine_tables_spares_a_store_reading_blocks_the_window_left_behind() -> None:
    """The window's blocks are free in the engine while the store ordered at the prompt's end still reads them: not a
    broken fence (kvfsm fences them when they are handed out), where a returned request's blocks were the only ones
    spared."""
    rig = HybridRig(SimDevice(), SIM.shape, SIM.cpu_blocks, lag_copies=True)
    rig.add("writer", 1, PROMPT, WINDOW * SIM.shape.block_tokens)
    rig.step()
    rig.step({"writer": WINDOW * SIM.shape.block_tokens})
    slid = rig.connector.scheduler.requests["writer@g1"].slid
    assert slid & set(rig.free) & {b for job in rig.connector.scheduler.jobs.values() if job.in_flight
                                   for b in job.gpu_blocks}
    assert fence_in_tables(rig.checks.integration) == []
    rig.close()


def test_request_ids_holding_the_group_separator_round_trip_under_their_own_ids() -> None:
    """The rig tells a request's loads apart by the ids it recorded (`kvfsm.connector.tracked_ids`), never by
    parsing: a request id may hold `@g`."""
    rig = HybridRig(SimDevice(), SIM.shape, SIM.cpu_blocks, lag_copies=True)
    try:
        run = trial(rig, SIM, 1, prefix="chat@gpt-")
    finally:
        rig.close()
    assert run.stored == run.loaded == {"full": PROMPT, "window": WINDOW, "state": 1}
    assert (run.corrupted, run.broken) == ({"full": 0, "window": 0, "state": 0}, ())


def test_a_request_id_naming_another_requests_group_is_refused_before_it_is_added() -> None:
    rig = HybridRig(SimDevice(), SIM.shape, SIM.cpu_blocks)
    rig.add("chat", 1, PROMPT)
    with pytest.raises(TrackedIdClash, match="'chat@g1'"):
        rig.add("chat@g1", 2, PROMPT)
    assert set(rig.requests) == {"chat"}
    rig.close()


def test_the_trials_table_runs_on_the_simulator_without_cuda() -> None:
    run = CliRunner().invoke(app, ["--trials", "1", "--device", "sim"])
    assert run.exit_code == 0, run.output
    assert "control no-slide" in run.output and "SimDevice" in run.output
