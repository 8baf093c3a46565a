"""Every public entry point refuses illegal input by name, before any state changes.

Each refusal below names its exception, and compares a snapshot of the whole connector (both halves, the
manager, the device) before and after: a refused call leaves the connector exactly as it was.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

import pydantic
import pytest
import torch

from kvfsm.config import OffloadConfig, PoolTooSmall
from kvfsm.connector import Connector, SchedulerConnector, WorkerConnector
from kvfsm.connector.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    LoadOrder,
    ScheduledRequest,
    SchedulerOutput,
    WorkerOutput,
)
from kvfsm.connector.refusals import (
    AlreadyRegistered,
    BlockIdOutOfRange,
    BlockSizeMismatch,
    ContradictoryStep,
    DuplicateBlockIds,
    IllegalCall,
    MalformedRequest,
    MoreTokensThanOffered,
    NegativeTokenCount,
    NotPositive,
    NotRegistered,
    RequestStateForbids,
    ReusedJobId,
    TokenCountBeyondRequest,
    TooFewBlocks,
    UnalignedTokenCount,
    UnknownJob,
    UnknownRequest,
    UnknownWorker,
    WrongType,
)
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.sim import SimDevice
from kvfsm.machines import MachineSet
from kvfsm.testing.snapshot import snapshot

BLOCK = 4
"""Tokens per GPU block."""
NUM_BLOCKS = 16
"""GPU blocks in the registered KV cache."""
PREFIX = (101, 102, 103)
"""Block hashes of the prefix stored in CPU before each case."""


@dataclass
class Req:
    request_id: str
    block_hashes: tuple[int, ...]
    num_tokens: int


def caches(block_tokens: int = BLOCK) -> dict[str, torch.Tensor]:
    tensors, _ = allocate_kv_caches("kv-first", 2, NUM_BLOCKS, block_tokens, 1, 4, torch.float32, "cpu")
    return tensors


def registered(machines: MachineSet | None = None, **config: Any) -> Connector:
    connector = Connector(OffloadConfig(**{"cpu_blocks": 8, "gpu_block_size": BLOCK, **config}), SimDevice(),
                          machines=machines)
    connector.register_kv_caches(caches(), "kv-first")
    return connector


def scheduled(req_id: str, blocks: tuple[int, ...], computed: int) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, block_ids=blocks, num_computed_tokens=computed)


def done(*job_ids: int, worker: int = 0) -> WorkerOutput:
    return WorkerOutput(worker=worker, done=job_ids)


@dataclass
class World:
    """A connector with the prefix stored and one request in each state a case needs."""

    connector: Connector
    matched: Req  # looked up, offered the stored prefix (12 tokens), not allocated yet
    running: Req  # allocated blocks 4-6, nothing in flight
    loading: Req  # loading the stored prefix into blocks 8-10, its load job in flight
    load_job: int


def world() -> World:
    c = registered()
    first = Req("first", PREFIX, len(PREFIX) * BLOCK + 1)
    offers = [c.get_num_new_matched_tokens(first, 0)]
    c.update_state_after_alloc(first, (0, 1, 2, 3), 0)
    stores = c.build_connector_meta(SchedulerOutput(scheduled=(scheduled("first", (0, 1, 2, 3), 13),))).stores
    c.build_connector_meta(SchedulerOutput())
    c.update_connector_output(ConnectorOutput(workers=(done(*(s.job_id for s in stores)),)))
    c.request_finished("first")
    matched = Req("matched", PREFIX, 13)
    offers.append(c.get_num_new_matched_tokens(matched, 0))
    loading = Req("loading", PREFIX, 13)
    offers.append(c.get_num_new_matched_tokens(loading, 0))
    c.update_state_after_alloc(loading, (8, 9, 10, 11), 12)
    (load,) = c.build_connector_meta(SchedulerOutput()).loads
    running = Req("running", (201, 202), 9)
    offers.append(c.get_num_new_matched_tokens(running, 0))
    c.update_state_after_alloc(running, (4, 5, 6), 0)
    if offers != [(0, False), (12, True), (12, True), (0, False)]:  # not an assert: this also runs under -O
        raise RuntimeError(f"the world was not built as the cases expect: offers {offers}")
    return World(c, matched, running, loading, load.job_id)


Case = Callable[[World], Callable[[], object]]

REFUSALS: dict[str, tuple[type[Exception], Case]] = {
    # get_num_new_matched_tokens
    "lookup-negative-computed-tokens": (
        NegativeTokenCount, lambda w: lambda: w.connector.get_num_new_matched_tokens(Req("new", (301,), 5), -5)),
    "lookup-computed-tokens-beyond-the-request": (
        TokenCountBeyondRequest, lambda w: lambda: w.connector.get_num_new_matched_tokens(Req("new", (301,), 5), 6)),
    "lookup-float-token-count": (
        WrongType, lambda w: lambda: w.connector.get_num_new_matched_tokens(Req("new", (301,), 5), 4.0)),
    "lookup-bool-token-count": (
        WrongType, lambda w: lambda: w.connector.get_num_new_matched_tokens(Req("new", (301,), 5), True)),
    "lookup-empty-request-id": (
        MalformedRequest, lambda w: lambda: w.connector.get_num_new_matched_tokens(Req("", (301,), 5), 0)),
    "lookup-more-hashes-than-full-blocks": (
        MalformedRequest, lambda w: lambda: w.connector.get_num_new_matched_tokens(Req("new", (1, 2, 3), 5), 0)),
    "lookup-negative-request-length": (
        MalformedRequest, lambda w: lambda: w.connector.get_num_new_matched_tokens(Req("new", (), -1), 0)),
    "lookup-float-request-length": (
        WrongType, lambda w: lambda: w.connector.get_num_new_matched_tokens(Req("new", (), 5.0), 0)),  # type: ignore
    "lookup-not-a-request": (
        WrongType, lambda w: lambda: w.connector.get_num_new_matched_tokens(object(), 0)),  # type: ignore[arg-type]
    "lookup-of-a-running-request": (
        RequestStateForbids, lambda w: lambda: w.connector.get_num_new_matched_tokens(w.running, 0)),
    # slide (the vLLM adapter's, under its hybrid allocator)
    "slide-of-an-unknown-request": (
        UnknownRequest, lambda w: lambda: w.connector.scheduler.slide("ghost", [4])),
    "slide-of-a-matched-request": (
        RequestStateForbids, lambda w: lambda: w.connector.scheduler.slide(w.matched.request_id, [12])),
    "slide-block-beyond-the-cache": (
        BlockIdOutOfRange, lambda w: lambda: w.connector.scheduler.slide(w.running.request_id, [99])),
    "slide-block-named-twice": (
        DuplicateBlockIds, lambda w: lambda: w.connector.scheduler.slide(w.running.request_id, [4, 4])),
    # update_state_after_alloc
    "alloc-before-lookup": (
        UnknownRequest, lambda w: lambda: w.connector.update_state_after_alloc(Req("ghost", (), 3), [0], 0)),
    "alloc-of-a-running-request": (
        RequestStateForbids, lambda w: lambda: w.connector.update_state_after_alloc(w.running, [4, 5, 6], 0)),
    "alloc-block-beyond-the-cache": (
        BlockIdOutOfRange, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, [12, 13, 99], 0)),
    "alloc-negative-block": (
        BlockIdOutOfRange, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, [-1, 13, 14], 0)),
    "alloc-block-named-twice": (
        DuplicateBlockIds, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, [12, 12, 13], 0)),
    "alloc-block-ids-not-ints": (
        WrongType, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, ["12"], 0)),  # type: ignore
    "alloc-block-ids-a-string": (
        WrongType, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, "12", 0)),  # type: ignore
    "alloc-block-at-the-cache-size": (
        BlockIdOutOfRange, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, [12, 13, 16], 0)),
    "alloc-empty-request-id": (
        MalformedRequest, lambda w: lambda: w.connector.update_state_after_alloc(Req("", (), 3), [0], 0)),
    "alloc-more-tokens-than-offered": (
        MoreTokensThanOffered, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, [12, 13, 14, 15], 16)),
    "alloc-tokens-not-whole-blocks": (
        UnalignedTokenCount, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, [12, 13, 14, 15], 6)),
    "alloc-negative-external-tokens": (
        NegativeTokenCount, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, [12, 13, 14], -4)),
    "alloc-too-few-blocks-for-the-load": (
        TooFewBlocks, lambda w: lambda: w.connector.update_state_after_alloc(w.matched, [12, 13], 12)),
    # build_connector_meta
    "step-not-a-scheduler-output": (
        WrongType, lambda w: lambda: w.connector.build_connector_meta({"scheduled": ()})),  # type: ignore[arg-type]
    "step-preempts-an-unknown-request": (
        UnknownRequest, lambda w: lambda: w.connector.build_connector_meta(SchedulerOutput(preempted=("ghost",)))),
    "step-preempts-a-loading-request": (
        RequestStateForbids, lambda w: lambda: w.connector.build_connector_meta(SchedulerOutput(preempted=("loading",)))),
    "step-schedules-an-unknown-request": (
        UnknownRequest,
        lambda w: lambda: w.connector.build_connector_meta(SchedulerOutput(scheduled=(scheduled("ghost", (1,), 4),)))),
    "step-preempts-and-schedules-one-request": (
        ContradictoryStep, lambda w: lambda: w.connector.build_connector_meta(SchedulerOutput(
            scheduled=(scheduled("running", (4, 5, 6), 8),), preempted=("running",)))),
    "step-schedules-a-request-twice": (
        ContradictoryStep, lambda w: lambda: w.connector.build_connector_meta(SchedulerOutput(
            scheduled=(scheduled("running", (4, 5, 6), 8), scheduled("running", (4, 5, 6), 8))))),
    "step-block-beyond-the-cache": (
        BlockIdOutOfRange, lambda w: lambda: w.connector.build_connector_meta(SchedulerOutput(
            scheduled=(scheduled("running", (4, 5, 99), 8),)))),
    "step-negative-computed-tokens": (
        NegativeTokenCount, lambda w: lambda: w.connector.build_connector_meta(SchedulerOutput(
            scheduled=(scheduled("running", (4, 5, 6), -1),)))),
    "step-columns-of-different-lengths": (  # validation refuses this; an output built with model_construct can
        ContradictoryStep, lambda w: lambda: w.connector.build_connector_meta(SchedulerOutput.model_construct(
            req_ids=("running",), block_ids=(), num_computed_tokens=(8,)))),
    # update_connector_output
    "report-of-an-unknown-job": (
        UnknownJob, lambda w: lambda: w.connector.update_connector_output(ConnectorOutput(workers=(done(999),)))),
    "report-from-an-unknown-worker": (
        UnknownWorker,
        lambda w: lambda: w.connector.update_connector_output(ConnectorOutput(workers=(done(w.load_job, worker=3),)))),
    "report-of-one-job-twice-in-one-output": (
        UnknownJob, lambda w: lambda: w.connector.update_connector_output(
            ConnectorOutput(workers=(done(w.load_job), done(w.load_job))))),
    "report-good-then-bad-applies-neither": (
        UnknownJob, lambda w: lambda: w.connector.update_connector_output(
            ConnectorOutput(workers=(done(w.load_job), done(999))))),
    # request_finished
    "finish-with-a-non-str-id": (
        MalformedRequest, lambda w: lambda: w.connector.request_finished(5)),  # type: ignore[arg-type]
    "finish-with-a-non-bool-aborted": (
        WrongType, lambda w: lambda: w.connector.request_finished("running", aborted="yes")),  # type: ignore
    "finish-of-a-loading-request": (
        RequestStateForbids, lambda w: lambda: w.connector.request_finished("loading")),
    # the worker half
    "register-twice": (
        AlreadyRegistered, lambda w: lambda: w.connector.register_kv_caches(caches(), "kv-first")),
    "bind-something-not-metadata": (
        WrongType, lambda w: lambda: w.connector.worker.bind_connector_metadata({"step": 1})),  # type: ignore
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_an_illegal_call_is_refused_by_name_and_changes_nothing(case: str) -> None:
    exception, make_call = REFUSALS[case]
    w = world()
    call = make_call(w)
    before = snapshot(w.connector)
    with pytest.raises(exception) as refused:
        call()
    assert type(refused.value) is exception, f"{case} raised {type(refused.value).__name__}"
    assert isinstance(refused.value, IllegalCall) and str(refused.value), "an illegal call names what was wrong"
    assert snapshot(w.connector) == before, f"{case}: the refused call changed the connector"


CALL_OF_CASE = {"lookup": "get_num_new_matched_tokens", "alloc": "update_state_after_alloc",
                "step": "build_connector_meta", "report": "update_connector_output", "finish": "request_finished",
                "register": "register_kv_caches", "bind": "bind_connector_metadata", "slide": "slide"}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refusal_names_the_call_it_refused(case: str) -> None:
    """An engine calls several entry points per step: the error says which one it misused."""
    exception, make_call = REFUSALS[case]
    with pytest.raises(exception) as refused:
        make_call(world())()
    assert str(refused.value).startswith(f"{CALL_OF_CASE[case.split('-')[0]]}: "), str(refused.value)


def test_the_snapshot_sees_a_change_a_refusal_would_have_made() -> None:
    """Control: the comparison above is not blind; one counter moved anywhere in the connector shows."""
    w = world()
    before = snapshot(w.connector)
    w.connector.scheduler.manager.blocks[0].readers += 1
    assert snapshot(w.connector) != before


# --- the four cases the issue names ------------------------------------------------------------------------


def test_a_gpu_block_beyond_the_registered_cache_is_refused_at_allocation() -> None:
    c = registered()
    request = Req("r", (1, 2), 9)
    c.get_num_new_matched_tokens(request, 0)
    before = snapshot(c)
    with pytest.raises(BlockIdOutOfRange, match=r"\[99\].*legal ids: \[0, 16\)"):
        c.update_state_after_alloc(request, [0, 1, 99], 0)
    assert snapshot(c) == before


def test_a_negative_computed_token_count_is_refused_not_deferred() -> None:
    c = registered()
    before = snapshot(c)
    with pytest.raises(NegativeTokenCount, match="num_computed_tokens is -5; a token count is 0 or more"):
        c.get_num_new_matched_tokens(Req("r", (1, 2), 9), -5)
    assert snapshot(c) == before


def test_a_kv_cache_paged_differently_from_the_config_is_refused_before_pinning() -> None:
    device = SimDevice()
    c = Connector(OffloadConfig(cpu_blocks=8, gpu_block_size=4), device)
    before = snapshot(c)
    with pytest.raises(BlockSizeMismatch, match="holds 5 tokens per block, but OffloadConfig.gpu_block_size is 4"):
        c.register_kv_caches(caches(block_tokens=5), "kv-first")
    assert device.host_bytes == 0, "a refused registration pinned host memory"
    assert snapshot(c) == before
    with pytest.raises(NotRegistered):
        _ = c.scheduler


def test_accepting_more_tokens_than_offered_is_refused_even_under_python_O() -> None:
    """The refusal is a named exception, not an `assert` that `python -O` strips."""
    script = (
        "from tests.test_boundaries import world; from kvfsm.connector.refusals import MoreTokensThanOffered\n"
        "w = world()\n"
        "try:\n    w.connector.update_state_after_alloc(w.matched, [12, 13, 14, 15], 16)\n"
        "except MoreTokensThanOffered as e:\n    print('refused:', e)\n"
    )
    run = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "refused: update_state_after_alloc: request 'matched' accepted 16 external tokens" in run.stdout


# --- construction and registration: refused before anything is allocated ------------------------------------


def test_a_config_that_is_not_an_offload_config_is_refused_by_wrong_type() -> None:
    with pytest.raises(WrongType, match="config must be a OffloadConfig, got dict"):
        Connector({"cpu_blocks": 8}, SimDevice())  # type: ignore[arg-type]


def test_a_device_without_the_device_protocol_is_refused_by_wrong_type() -> None:
    with pytest.raises(WrongType, match="device must implement kvfsm.executor.Device"):
        Connector(OffloadConfig(cpu_blocks=8), object())  # type: ignore[arg-type]


def test_a_worker_rank_beyond_num_workers_is_refused_by_unknown_worker() -> None:
    with pytest.raises(UnknownWorker, match="worker 2; legal ranks with num_workers=2: 0 to 1"):
        WorkerConnector(OffloadConfig(cpu_blocks=8, num_workers=2), SimDevice(), worker=2)


@pytest.mark.parametrize("sizes", [{"gpu_block_bytes": 0}, {"gpu_block_bytes": 64, "num_gpu_blocks": 0}])
def test_a_scheduler_half_of_no_bytes_or_no_blocks_is_refused_by_not_positive(sizes: dict[str, int]) -> None:
    with pytest.raises(NotPositive, match="legal: 1 or more"):
        SchedulerConnector(OffloadConfig(cpu_blocks=8), **sizes)


def test_a_pool_too_small_for_one_cpu_block_is_refused_before_pinning() -> None:
    device = SimDevice()
    c = Connector(OffloadConfig(cpu_bytes=16, gpu_block_size=BLOCK), device)
    with pytest.raises(PoolTooSmall, match="holds no CPU block of 256 bytes; legal: at least 256"):
        c.register_kv_caches(caches(), "kv-first")
    assert device.host_bytes == 0


@pytest.mark.parametrize("fields", [
    {"cpu_blocks": 8, "poison": True},  # an unknown key
    {"cpu_blocks": 0},  # not positive
    {"cpu_blocks": 8, "cpu_bytes": 1 << 20},  # two pool sizes
    {},  # no pool size
    {"cpu_blocks": 8, "eviction": "fifo"},  # an unknown policy
    {"cpu_blocks": 8, "gpu_block_size": 2.5},  # not a whole number of tokens
])
def test_an_illegal_offload_config_is_refused_by_pydantic_naming_the_field(fields: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        OffloadConfig(**fields)


def test_an_order_reusing_a_job_id_in_flight_is_refused_by_the_worker() -> None:
    worker = WorkerConnector(OffloadConfig(cpu_blocks=8, gpu_block_size=BLOCK), SimDevice())
    worker.register_kv_caches(caches(), "kv-first")
    load = LoadOrder(job_id=7, req_id="r", gpu_blocks=(0,), cpu_slots=(0,))
    worker.bind_connector_metadata(ConnectorMetadata(step=1, loads=(load,)))
    worker.start_load_kv()
    before = snapshot(worker)
    with pytest.raises(ReusedJobId, match=r"job ids \[7\] are already in flight"):
        worker.bind_connector_metadata(ConnectorMetadata(step=2, loads=(load,)))
    assert snapshot(worker) == before
