"""A state-space KV-cache group tracked beside its prefix, on the connector's scheduler half driven directly: a prefix
is offered only with the state at its end (`match_together`), and `state-at-prefix-end` holds, or names the request
whose state was restored apart from its prefix. The engine's side (vLLM's Mamba group) is `test_vllm_mamba.py`.
"""

from __future__ import annotations

from typing import Sequence

import pytest

from kvfsm.checking.world import ConnectorWorld
from kvfsm.connector.refusals import UnknownRequest
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.group_invariants import state_at_prefix_end
from kvfsm.testing.mutants import restore_without_state
from test_connector_scheduler import BLOCK, Req, compute, connector, idle_step, prompt, report

STATE_KEYS = 1000
"""The state group's keys are the prefix's hashes offset by this (an engine gives each group keys of its own)."""
PREFIX_BLOCKS, STATE_BLOCKS = range(0, 5), range(50, 55)
"""The GPU blocks an engine gives the prefix and, apart, its state (the prompts here fill four blocks at most)."""


def requests(req_id: str, hashes: Sequence[int]) -> tuple[Req, Req]:
    """An engine request's prefix and its state (`<req_id>@g1`, keys of its own)."""
    return prompt(req_id, hashes), prompt(f"{req_id}@g1", [h + STATE_KEYS for h in hashes])


def admit_both(sched: SchedulerConnector, hashes: Sequence[int], req_id: str, prefix_tokens: int,
               state_tokens: int) -> None:
    """The engine allocates request `req_id` and its state (blocks apart from the prefix's), each with its load."""
    prefix, state = requests(req_id, hashes)
    sched.update_state_after_alloc(prefix, PREFIX_BLOCKS, prefix_tokens)
    sched.update_state_after_alloc(state, STATE_BLOCKS, state_tokens, store_from=len(hashes) - 1, state_of=req_id)


def store_with_state(sched: SchedulerConnector, hashes: Sequence[int]) -> None:
    """Request "w" stores its prefix's blocks, and its state request "w@g1" only the state at the prompt's end."""
    prefix, state = requests("w", hashes)
    for req in (prefix, state):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    admit_both(sched, hashes, "w", 0, 0)
    jobs = [order.job_id for req, blocks in ((prefix, PREFIX_BLOCKS), (state, STATE_BLOCKS))
            for order in compute(sched, req, blocks).stores]
    idle_step(sched)
    report(sched, done=jobs)
    for req in (prefix, state):
        sched.request_finished(req.request_id)


def restore(sched: SchedulerConnector, hashes: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Reader "r" looks its prefix up, its state "r@g1" the block at the prefix hit's end, both offered together,
    and both allocated as an engine would: the GPU blocks [first, end) the prefix and its state each load."""
    prefix, state = requests("r", hashes)
    tokens, _ = sched.get_num_new_matched_tokens(prefix, 0) or (0, False)
    end = tokens // BLOCK
    sched.get_num_new_matched_tokens(state, max(0, end - 1) * BLOCK)
    if not sched.match_together("r", ["r@g1"], end):
        tokens = 0
    _, count = sched.requests["r@g1"].match or (0, 0)
    admit_both(sched, hashes, "r", tokens, count * BLOCK if tokens else 0)
    return sched.requests["r"].restored[1:], sched.requests["r@g1"].restored[1:]


def test_a_prefix_is_restored_with_the_one_state_block_at_its_end() -> None:
    sched = connector()
    store_with_state(sched, [1, 2, 3, 4])
    assert sched.stats.blocks_stored == 4 + 1, "the state stored more than the block at its prompt's end"
    assert restore(sched, [1, 2, 3, 4]) == ((0, 4), (3, 4))
    assert len(sched.jobs[max(sched.jobs)].gpu_blocks) == 1
    assert state_at_prefix_end(ConnectorWorld(sched)) == []


def test_a_prefix_whose_state_at_its_end_was_not_stored_is_no_hit() -> None:
    sched = connector()
    store_with_state(sched, [1, 2, 3, 4])
    assert restore(sched, [1, 2, 3]) == ((0, 0), (0, 0))
    assert state_at_prefix_end(ConnectorWorld(sched)) == []


def test_control_a_prefix_restored_without_its_state_is_named() -> None:
    sched = connector()
    restore_without_state(sched)
    store_with_state(sched, [1, 2, 3, 4])
    assert restore(sched, [1, 2, 3]) == ((0, 3), (0, 0))
    (found,) = state_at_prefix_end(ConnectorWorld(sched))
    assert "r loaded GPU blocks [0, 3) but its state r@g1 restored [0, 0)" in found


def test_a_state_allocated_apart_from_its_prefix_is_named() -> None:
    sched = connector()
    store_with_state(sched, [1, 2, 3, 4])
    restore(sched, [1, 2, 3, 4])
    sched.requests["r@g1"].restored = (sched.step + 1, 3, 4)
    (found,) = state_at_prefix_end(ConnectorWorld(sched))
    assert "a state is restored only with its prefix" in found


def test_a_state_of_a_request_not_tracked_is_refused_before_any_state_changes() -> None:
    sched = connector()
    _, state = requests("r", [1, 2])
    sched.get_num_new_matched_tokens(state, 0)
    with pytest.raises(UnknownRequest, match="is the state of 'r', which is not tracked"):
        sched.update_state_after_alloc(state, STATE_BLOCKS, 0, store_from=1, state_of="r")
    assert sched.requests["r@g1"].state == "matched"
