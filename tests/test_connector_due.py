"""The due points and the remembered quiet batch: a steady decode step is checked in C, and refuses what a full
check refuses."""

from __future__ import annotations

import pytest

from kvfsm.config import OffloadConfig
from kvfsm.connector.due import StoreDue
from kvfsm.connector.metadata import ConnectorOutput, ScheduledRequest, SchedulerOutput, WorkerOutput
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.connector.refusals import ContradictoryStep, NegativeTokenCount, UnknownRequest

BLOCK = 4


class Req:
    """A prompt of `blocks` full GPU blocks and a token; `grow` adds a block's hash as an engine's decode fills it."""

    def __init__(self, request_id: str, blocks: int) -> None:
        self.request_id = request_id
        self.block_hashes = tuple(hash((request_id, i)) for i in range(blocks))
        self.num_tokens = blocks * BLOCK + 1

    def grow(self) -> None:
        self.block_hashes += (hash((self.request_id, len(self.block_hashes))),)
        self.num_tokens = len(self.block_hashes) * BLOCK + 1


def remembered(dues: tuple[int, ...] = (4, 8)) -> tuple[StoreDue, tuple[str, ...]]:
    due = StoreDue()
    ids = tuple(f"r{i}" for i in range(len(dues)))
    for req_id, tokens in zip(ids, dues):
        due.set(req_id, tokens)
    due.remember_quiet(ids, due.of(ids))
    return due, ids


def test_a_remembered_batch_is_quiet_while_every_count_is_from_zero_to_below_its_due_point() -> None:
    due, ids = remembered((4, 8))
    assert due.known_quiet(ids, (0, 7))
    assert due.known_quiet(ids, (3, 0))
    assert not due.known_quiet(ids, (4, 7)), "a request at its due point completed a CPU block"
    assert not due.known_quiet(ids, (3, 8))
    assert not due.known_quiet(ids, (-1, 7)), "a negative count must reach the full check"


def test_a_remembered_batch_answers_only_for_the_same_requests_in_the_same_order() -> None:
    due, ids = remembered((4, 8))
    assert not due.known_quiet(tuple(reversed(ids)), (3, 3))
    assert not due.known_quiet(ids[:1], (3,))


def test_moving_or_forgetting_a_due_point_forgets_the_quiet_batch() -> None:
    due, ids = remembered((4, 8))
    due.set("r0", 12)
    assert not due.known_quiet(ids, (3, 3))
    due, ids = remembered((4, 8))
    due.forget("r1")
    assert not due.known_quiet(ids, (3, 3))
    assert not StoreDue().known_quiet(ids, (3, 3)), "nothing remembered, nothing known"


def test_due_points_are_read_for_one_request_and_for_many_and_an_untracked_one_is_a_key_error() -> None:
    due, ids = remembered((4, 8))
    assert due.of(ids) == (4, 8)
    assert due.of(("r1",)) == (8,)
    with pytest.raises(KeyError):
        due.of(("r0", "ghost"))


def running(count: int) -> tuple[SchedulerConnector, list[Req]]:
    """`count` requests of two GPU blocks admitted as misses, prefilled and stored: next they decode."""
    sched = SchedulerConnector(OffloadConfig(cpu_blocks=64, gpu_block_size=BLOCK), 64, num_gpu_blocks=64)
    requests = [Req(f"r{i}", 2) for i in range(count)]
    for i, req in enumerate(requests):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, (3 * i, 3 * i + 1, 3 * i + 2), 0)
    meta = step(sched, requests, [r.num_tokens for r in requests])
    assert len(meta.stores) == count
    sched.update_connector_output(ConnectorOutput())
    step(sched, requests, [r.num_tokens for r in requests])  # the stores are submitted
    sched.update_connector_output(ConnectorOutput(workers=(WorkerOutput(done=tuple(o.job_id for o in meta.stores)),)))
    return sched, requests


def step(sched: SchedulerConnector, requests: list[Req], computed: list[int],  # type: ignore[no-untyped-def]
         preempted: tuple[str, ...] = ()):
    return sched.build_connector_meta(SchedulerOutput(scheduled=tuple(
        ScheduledRequest(r.request_id, tuple(range(3 * int(r.request_id[1:]), 3 * int(r.request_id[1:]) + 3)), c)
        for r, c in zip(requests, computed)), preempted=preempted))


def test_a_decode_step_after_quiet_ones_still_refuses_a_negative_token_count() -> None:
    sched, requests = running(3)
    tokens = [r.num_tokens + 1 for r in requests]
    assert not step(sched, requests, tokens).stores
    assert not step(sched, requests, tokens).stores  # remembered quiet
    with pytest.raises(NegativeTokenCount):
        step(sched, requests, [tokens[0], -1, tokens[2]])


def test_a_request_completing_a_cpu_block_after_quiet_steps_is_stored() -> None:
    sched, requests = running(3)
    tokens = [r.num_tokens + 1 for r in requests]
    for _ in range(2):
        assert not step(sched, requests, tokens).stores
    requests[1].grow()
    (order,) = step(sched, requests, [tokens[0], 3 * BLOCK, tokens[2]]).stores
    assert order.req_id == "r1" and order.gpu_blocks == (5,)


def test_a_released_request_named_again_in_a_remembered_batch_is_refused() -> None:
    sched, requests = running(2)
    tokens = [r.num_tokens + 1 for r in requests]
    for _ in range(2):
        step(sched, requests, tokens)
    assert sched.request_finished("r0") is False  # its stores are done: released at once
    with pytest.raises(UnknownRequest):
        step(sched, requests, tokens)


def test_a_remembered_batch_that_also_preempts_one_of_its_requests_is_refused() -> None:
    sched, requests = running(2)
    tokens = [r.num_tokens + 1 for r in requests]
    for _ in range(2):
        step(sched, requests, tokens)  # the second is remembered quiet
    with pytest.raises(ContradictoryStep):
        step(sched, requests, tokens, preempted=("r1",))
