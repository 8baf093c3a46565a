"""Each refusal says which call was refused, what was wrong and what is legal, word for word.

An engine's operator reads these messages when an integration misuses the connector; a mutant that blanks a field
of one, or names the wrong bound, must fail here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfsm.config import DiskTierConfig, OffloadConfig
from kvfsm.bindings import default_registry, default_spec
from kvfsm.connector import (
    Connector,
    RankBlockSizeMismatch,
    SchedulerConnector,
    WorkerConnector,
    WorkerCountMismatch,
)
from kvfsm.connector.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    SchedulerOutput,
    StoreOrder,
    TierReport,
    WorkerOutput,
)
from kvfsm.connector.refusals import (
    BlockIdOutOfRange,
    ContradictoryStep,
    NegativeTokenCount,
    NotPositive,
    NotRegistered,
    RequestStateForbids,
    ReusedJobId,
    UnknownJob,
    UnknownWorker,
    WrongType,
)
from kvfsm.executor import CudaDevice, CudaUnavailable
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.sim import SimDevice
from kvfsm.machines import MachineSet
from kvfsm.spec import load_spec
from kvfsm.testing.snapshot import snapshot
from kvfsm.testing.spec_mutants import SpecMutant, shipped
from kvfsm.invariants import Deferral
from test_boundaries import BLOCK, NUM_BLOCKS, PREFIX, REFUSALS, Req, caches, registered, scheduled, world
from test_connector_scheduler import connector as scheduler_half, prompt, store_prefix

MESSAGES = {
    "alloc-before-lookup": "update_state_after_alloc: request 'ghost' was never looked up; call "
                           "get_num_new_matched_tokens first",
    "alloc-block-at-the-cache-size": "update_state_after_alloc: GPU block ids [16] of request 'matched' are outside "
                                     "the KV cache; legal ids: [0, 16)",
    "alloc-block-ids-a-string": "update_state_after_alloc: block_ids must be a sequence of ints, got str",
    "alloc-block-ids-not-ints": "update_state_after_alloc: a block id of request 'matched' must be an int, got str "
                                "'12'",
    "alloc-empty-request-id": "update_state_after_alloc: request_id must be a non-empty str, got ''",
    "alloc-negative-block": "update_state_after_alloc: GPU block ids [-1] of request 'matched' are outside the KV "
                            "cache; legal ids: [0, 16)",
    "alloc-negative-external-tokens": "update_state_after_alloc: num_external_tokens is -4; a token count is 0 or "
                                      "more",
    "alloc-of-a-running-request": "update_state_after_alloc: request 'running' is running, which has no 'allocate' "
                                  "transition; legal only for a request that is matched",
    "alloc-block-beyond-the-cache": "update_state_after_alloc: GPU block ids [99] of request 'matched' are outside "
                                    "the KV cache; legal ids: [0, 16)",
    "alloc-block-named-twice": "update_state_after_alloc: request 'matched' names GPU blocks [12] more than once; "
                               "each block once",
    "alloc-more-tokens-than-offered": "update_state_after_alloc: request 'matched' accepted 16 external tokens, but "
                                      "the lookup offered 12; legal: 0 to 12 in multiples of 4",
    "alloc-too-few-blocks-for-the-load": "update_state_after_alloc: request 'matched' got 2 GPU blocks; loading 3 "
                                         "blocks after its 0 cached ones needs 3 or more",
    "bind-something-not-metadata": "bind_connector_metadata: meta must be a ConnectorMetadata, got dict",
    "finish-of-a-loading-request": "request_finished: request 'loading' is loading, which has no 'finish' transition; "
                                   "legal only for a request that is loading-inline or running",
    "finish-with-a-non-bool-aborted": "request_finished: aborted must be a bool, got str",
    "lookup-bool-token-count": "get_num_new_matched_tokens: num_computed_tokens must be an int, got the bool True",
    "lookup-float-request-length": "get_num_new_matched_tokens: request 'new' num_tokens must be an int, got float "
                                   "5.0",
    "lookup-float-token-count": "get_num_new_matched_tokens: num_computed_tokens must be an int, got float 4.0",
    "lookup-more-hashes-than-full-blocks": "get_num_new_matched_tokens: request 'new' has 3 block hashes for 5 "
                                           "tokens; legal: one per full 4-token block, at most 1",
    "lookup-of-a-running-request": "get_num_new_matched_tokens: request 'running' is running, which has no 'lookup' "
                                   "transition; legal only for a request that is deferred, matched, new or "
                                   "preempted",
    "report-from-an-unknown-worker": "update_connector_output: a report from worker 3; legal ranks: 0 to 0",
    "report-of-an-unknown-job": "update_connector_output: worker 0 reported job 999, which is not in flight for it; "
                                "legal: each job in flight, once per worker",
    "step-block-beyond-the-cache": "build_connector_meta: GPU block ids [99] of request 'running' are outside the "
                                   "KV cache; legal ids: [0, 16)",
    "step-columns-of-different-lengths": "build_connector_meta: 1 req_ids, 0 block_ids and 1 num_computed_tokens; "
                                         "legal: one of each per scheduled request",
    "step-negative-computed-tokens": "build_connector_meta: request 'running' has num_computed_tokens -1; legal: 0 "
                                     "or more",
    "step-not-a-scheduler-output": "build_connector_meta: output must be a SchedulerOutput, got dict",
    "step-preempts-a-loading-request": "build_connector_meta: request 'loading' is loading, which has no 'preempt' "
                                       "transition; legal only for a request that is running",
}


@pytest.mark.parametrize("case", sorted(MESSAGES))
def test_a_refusal_says_what_was_wrong_and_what_is_legal(case: str) -> None:
    exception, make_call = REFUSALS[case]
    with pytest.raises(exception) as refused:
        make_call(world())()
    assert str(refused.value) == MESSAGES[case]


def test_a_request_preempted_twice_in_one_step_is_refused_and_changes_nothing() -> None:
    w = world()
    before = snapshot(w.connector)
    with pytest.raises(ContradictoryStep) as refused:
        w.connector.build_connector_meta(SchedulerOutput(preempted=("running", "running")))
    assert str(refused.value) == "build_connector_meta: a request is preempted twice in one step; name each once"
    assert snapshot(w.connector) == before


def test_a_report_that_is_not_a_connector_output_is_refused_by_wrong_type() -> None:
    with pytest.raises(WrongType) as refused:
        world().connector.update_connector_output({"workers": ()})  # type: ignore[arg-type]
    assert str(refused.value) == "update_connector_output: output must be a ConnectorOutput, got dict"


def test_a_report_of_tier_jobs_without_a_lower_tier_is_refused_naming_the_worker() -> None:
    w = world()
    with pytest.raises(UnknownJob) as refused:
        w.connector.update_connector_output(ConnectorOutput(workers=(WorkerOutput(tiers=(TierReport(job_id=5),)),)))
    assert str(refused.value).endswith("worker 0 reported tier jobs, but no lower tier is configured")



def test_a_report_of_a_tier_job_not_in_flight_is_refused_word_for_word(tmp_path: Path) -> None:
    c = registered(lower_tiers=[DiskTierConfig(path=str(tmp_path), capacity_bytes=1 << 20)])
    try:
        with pytest.raises(UnknownJob) as refused:
            c.update_connector_output(ConnectorOutput(workers=(WorkerOutput(tiers=(TierReport(job_id=5),)),)))
    finally:
        c.worker.shutdown()
    assert str(refused.value) == ("update_connector_output: worker 0 reported tier job 5, which is not in flight for "
                                  "it; legal: each tier job in flight, once per worker")

def test_a_computed_token_count_of_zero_is_legal_in_a_step() -> None:
    w = world()
    w.connector.build_connector_meta(SchedulerOutput(scheduled=(scheduled("running", (4, 5, 6), 0),)))


def test_a_device_without_the_device_protocol_is_refused_naming_the_connector_and_the_type() -> None:
    with pytest.raises(WrongType) as refused:
        Connector(OffloadConfig(cpu_blocks=8), object())  # type: ignore[arg-type]
    assert str(refused.value).startswith("Connector: device must implement kvfsm.executor.Device; object lacks [")


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Connector({"cpu_blocks": 8}, SimDevice()), "Connector: config must be a OffloadConfig, got dict"),
    (lambda: WorkerConnector(OffloadConfig(cpu_blocks=8, num_workers=2), SimDevice(), worker="1"),
     "WorkerConnector: worker must be an int, got str '1'"),
    (lambda: Connector(OffloadConfig(cpu_blocks=8, gpu_block_size=BLOCK), SimDevice()).register_kv_caches(
        [], "kv-first"), "register_kv_caches: kv_caches must be a Mapping, got list"),
], ids=["config", "worker-rank", "kv-caches"])
def test_a_construction_or_registration_of_the_wrong_type_is_refused_naming_the_argument(make, message: str) -> None:
    with pytest.raises(WrongType) as refused:
        make()
    assert str(refused.value) == message


def test_a_negative_computed_token_count_is_refused_naming_the_request_that_has_it() -> None:
    w = world()
    step = SchedulerOutput(scheduled=(scheduled("running", (4, 5, 6), 0), scheduled("loading", (8, 9, 10, 11), -2)))
    with pytest.raises(NegativeTokenCount) as refused:
        w.connector.build_connector_meta(step)
    assert str(refused.value) == "build_connector_meta: request 'loading' has num_computed_tokens -2; legal: 0 or more"


def test_two_workers_with_a_lower_tier_are_refused_before_anything_is_opened(tmp_path: Path) -> None:
    config = OffloadConfig(cpu_blocks=8, num_workers=2,
                           lower_tiers=[DiskTierConfig(path=str(tmp_path), capacity_bytes=1 << 20)])
    with pytest.raises(WorkerCountMismatch) as refused:
        Connector(config, [SimDevice(), SimDevice()])
    assert str(refused.value) == ("Connector: 2 devices with num_workers=2 and 1 lower tiers; legal: one device per "
                                  "worker, lower tiers with one worker only or with replicated KV")


def test_a_rank_registering_another_block_size_in_bytes_is_refused_naming_both() -> None:
    c = Connector(OffloadConfig(cpu_blocks=8, num_workers=2, gpu_block_size=BLOCK), [SimDevice(), SimDevice()])
    c.register_kv_caches(caches(), "kv-first")
    wider, _ = allocate_kv_caches("kv-first", 2, NUM_BLOCKS, BLOCK, 2, 4, torch.float32, "cpu")
    with pytest.raises(RankBlockSizeMismatch) as refused:
        c.register_kv_caches(wider, "kv-first", rank=1)
    assert str(refused.value) == "rank 1 registered 512 bytes per GPU block, rank 0 256"


def test_registering_for_a_rank_without_a_device_is_refused_naming_the_legal_ranks() -> None:
    c = Connector(OffloadConfig(cpu_blocks=8, gpu_block_size=BLOCK), SimDevice())
    with pytest.raises(UnknownWorker) as refused:
        c.register_kv_caches(caches(), "kv-first", rank=1)
    assert str(refused.value) == "register_kv_caches: rank 1; legal ranks with 1 devices: 0 to 0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_is_refused_pointing_at_the_simulator() -> None:
    with pytest.raises(CudaUnavailable) as refused:
        CudaDevice()
    assert str(refused.value) == ("CudaDevice: torch sees no CUDA device here; on a CPU-only machine use "
                                  "kvfsm.executor.SimDevice")


def test_a_cuda_device_beyond_the_device_count_is_refused_naming_the_legal_indices(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(CudaUnavailable) as refused:
        CudaDevice(2)
    assert str(refused.value) == "CudaDevice: no CUDA device 2; legal: 0 to 1"


def test_binding_metadata_before_registering_is_refused_naming_the_call() -> None:
    c = Connector(OffloadConfig(cpu_blocks=8, gpu_block_size=BLOCK), SimDevice())
    store = StoreOrder(job_id=1, req_id="r", gpu_blocks=(0,), cpu_slots=(0,))
    with pytest.raises(NotRegistered) as refused:
        c.worker.bind_connector_metadata(ConnectorMetadata(step=1, stores=(store,)))
    assert str(refused.value) == ("bind_connector_metadata: register_kv_caches must run before transfers are "
                                  "ordered")


def test_a_connector_uses_the_machines_it_is_given_and_keeps_no_history_by_default() -> None:
    machines = MachineSet(default_spec(), backend="transitions")
    c = Connector(OffloadConfig(cpu_blocks=8, gpu_block_size=BLOCK), SimDevice(), machines=machines)
    assert c.machines is machines and not c.keep_history


def test_one_job_id_named_twice_in_one_step_is_refused_saying_so() -> None:
    w = world()
    orders = tuple(StoreOrder(job_id=77, req_id="running", gpu_blocks=(4,), cpu_slots=(slot,)) for slot in (5, 6))
    with pytest.raises(ReusedJobId) as refused:
        w.connector.worker.bind_connector_metadata(ConnectorMetadata(step=9, stores=orders))
    assert str(refused.value) == ("bind_connector_metadata: job ids named twice are already in flight on this "
                                  "worker; legal: a fresh id per order")


def test_a_lookup_of_a_prefix_being_loaded_is_deferred_to_the_next_step_naming_its_blockers() -> None:
    w = world()
    sched = w.connector.scheduler
    assert w.connector.get_num_new_matched_tokens(Req("third", PREFIX, 13), 0) is None
    assert sched.ledger.requests["third"].state == "deferred"
    assert sched.deferrals["third"] == Deferral(step=sched.step + 1, blockers=frozenset({w.load_job}))


def test_a_negative_block_id_is_refused_while_the_cache_size_is_unknown_saying_ids_are_zero_or_more() -> None:
    sched = scheduler_half()
    sched.get_num_new_matched_tokens(prompt("new", [7]), 0)
    with pytest.raises(BlockIdOutOfRange) as refused:
        sched.update_state_after_alloc(prompt("new", [7]), [3, -2], 0)
    assert str(refused.value) == ("update_state_after_alloc: GPU block ids [-2] of request 'new' are outside the KV "
                                  "cache; legal ids: 0 or more")


def test_a_load_after_a_gpu_prefix_fits_in_exactly_the_blocks_it_needs() -> None:
    sched = scheduler_half()
    store_prefix(sched, prompt("first", [1, 2, 3]), range(4))
    assert sched.get_num_new_matched_tokens(prompt("again", [1, 2, 3]), BLOCK) == (2 * BLOCK, True)
    sched.update_state_after_alloc(prompt("again", [1, 2, 3]), [5, 6, 7], 2 * BLOCK)  # 1 cached + 2 loaded
    assert sched.ledger.requests["again"].state == "loading"


def test_a_request_that_loads_nothing_may_be_allocated_no_blocks_whatever_its_gpu_prefix() -> None:
    sched = scheduler_half()
    assert sched.get_num_new_matched_tokens(prompt("new", [7, 8]), BLOCK) == (0, False)
    sched.update_state_after_alloc(prompt("new", [7, 8]), [], 0)
    assert sched.ledger.requests["new"].state == "running"


def test_a_refusal_names_the_legal_states_of_the_lifecycle_its_connector_runs(tmp_path: Path) -> None:
    """Two connectors in one process on different request lifecycles: each refuses by its own spec."""
    documents = shipped().documents
    for transition in documents["request.yaml"]["transitions"]:
        if transition["trigger"] == "finish" and transition["source"] == "running":
            transition["source"] = ["matched", "running"]
    variant = load_spec(SpecMutant("finish-from-matched", documents).write(tmp_path), registry=default_registry())
    shipped_world = world()
    with pytest.raises(RequestStateForbids, match="legal only for a request that is loading-inline or running$"):
        shipped_world.connector.request_finished("loading")
    c = registered(MachineSet(variant))
    c.get_num_new_matched_tokens(Req("r", (), 3), 0)
    c.update_state_after_alloc(Req("r", (), 3), [0], 0)
    c.build_connector_meta(SchedulerOutput(preempted=("r",)))
    with pytest.raises(RequestStateForbids) as refused:
        c.request_finished("r")
    assert str(refused.value) == ("request_finished: request 'r' is preempted, which has no 'finish' transition; "
                                  "legal only for a request that is loading-inline, matched or running")


def test_a_request_of_zero_tokens_is_looked_up_as_a_miss() -> None:
    assert scheduler_half().get_num_new_matched_tokens(Req("empty", (), 0), 0) == (0, False)


def test_a_lookup_may_count_every_token_of_the_request_as_computed() -> None:
    assert scheduler_half().get_num_new_matched_tokens(prompt("cached", [7, 8]), 2 * BLOCK + 1) == (0, False)


@pytest.mark.parametrize(("make", "exception", "message"), [
    (lambda: SchedulerConnector({"cpu_blocks": 8}, 64), WrongType,
     "SchedulerConnector: config must be a OffloadConfig, got dict"),
    (lambda: SchedulerConnector(OffloadConfig(cpu_blocks=8), 0), NotPositive,
     "SchedulerConnector: gpu_block_bytes is 0; legal: 1 or more"),
    (lambda: SchedulerConnector(OffloadConfig(cpu_blocks=8), 64, num_gpu_blocks=0), NotPositive,
     "SchedulerConnector: num_gpu_blocks is 0; legal: 1 or more"),
    (lambda: SchedulerConnector(OffloadConfig(cpu_blocks=8), 64.0), WrongType,
     "SchedulerConnector: gpu_block_bytes must be an int, got float 64.0"),
    (lambda: SchedulerConnector(OffloadConfig(cpu_blocks=8), 64, num_gpu_blocks="8"), WrongType,
     "SchedulerConnector: num_gpu_blocks must be an int, got str '8'"),
    (lambda: SchedulerConnector(OffloadConfig(cpu_blocks=8), None), WrongType,
     "SchedulerConnector: gpu_block_bytes is required (the bytes of one GPU block across all layers)"),
], ids=["config", "zero-block-bytes", "zero-gpu-blocks", "float-block-bytes", "str-gpu-blocks", "no-block-bytes"])
def test_a_scheduler_half_built_from_bad_arguments_is_refused_naming_the_argument(make, exception, message: str) -> None:
    with pytest.raises(exception) as refused:
        make()
    assert str(refused.value) == message


def test_a_scheduler_half_accepts_a_one_byte_block_and_a_one_block_cache() -> None:
    SchedulerConnector(OffloadConfig(cpu_blocks=8), 1, num_gpu_blocks=1)
