"""Tensor parallelism in one process: two ranks, each on its own SimDevice with its own drawn schedule and holding one
of the model's two heads, one scheduler half hearing both. kvfsm passes the generated interleavings; every control
that differs from kvfsm only with several ranks is caught; bad rank set-ups are named errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvfsm.config import OffloadConfig
from kvfsm.connector import Connector, WorkerCountMismatch
from kvfsm.connector.refusals import UnknownJob
from kvfsm.connector.worker import WorkerConnector
from kvfsm.engine.distributed import Command, ReadySlot, verify
from kvfsm.engine.config import EngineConfig, LayerByLayerOnOneDevice
from kvfsm.engine.engine import Engine
from kvfsm.engine.model import ModelShape
from kvfsm.engine.ranks import HeadsDoNotDivide, Rank
from kvfsm.executor.sim import SimDevice
from kvfsm.machines import IllegalTrigger
from kvfsm.testing.harness import TP_SHAPE, Harness
from kvfsm.testing.mutants import TP_MUTANTS
from kvfsm.engine.oracle import BlockOracle
from kvfsm.testing.tp_interleavings import tp_interleavings_for

MUTANT_BUDGET = 1500
"""Examples a mutant may survive. No shrinking: finding is enough."""
PROMPT = (11, 12, 13, 14, 15, 16, 17)
def two_ranks() -> Harness:
    return Harness([SimDevice(), SimDevice()], num_gpu_blocks=8, cpu_blocks=6, shape=TP_SHAPE)


def test_each_rank_pool_holds_its_own_heads_and_a_reload_gives_the_unsharded_tokens() -> None:
    harness = two_ranks()
    try:
        harness.add_request(PROMPT, 2)
        harness.drain()
        harness.engine.reset_prefix_cache()
        harness.add_request(PROMPT + (18, 19), 2)
        harness.drain()
        assert harness.engine.cpu_hit_tokens > 0, "the second request reloaded nothing from CPU"
        assert not harness.final_violations()  # tokens equal the one-device run's; each pool holds its heads' bytes
        pools = [worker.pool.buffer for worker in harness.connector.workers]
        assert not pools[0].equal(pools[1]), "both ranks' pools hold the same bytes: heads are not sharded"
    finally:
        harness.close()


def test_kvfsm_passes_tensor_parallel_interleavings() -> None:
    run_state_machine_as_test(tp_interleavings_for(None), settings=settings(settings()))


@pytest.mark.parametrize("mutant", sorted(TP_MUTANTS))
def test_tensor_parallel_mutant_is_caught(mutant: str) -> None:
    machine = tp_interleavings_for(mutant)
    hunt = settings(settings(), max_examples=MUTANT_BUDGET, phases=[Phase.generate], report_multiple_bugs=False,
                    print_blob=False, database=None)
    with pytest.raises((AssertionError, IllegalTrigger, UnknownJob)) as caught:
        run_state_machine_as_test(machine, settings=hunt)
    first_line = str(caught.value).splitlines()[0]
    print(f"\n{mutant} ({TP_MUTANTS[mutant].breaks}): caught after {machine.examples} examples: {first_line}")


def test_a_stray_write_to_one_rank_pool_is_found_on_that_rank() -> None:
    harness = two_ranks()
    try:
        harness.add_request(PROMPT, 1)
        harness.drain()
        assert not harness.violations()
        ready = next(b.slot for b in harness.connector.scheduler.manager.blocks if b.state == "ready")
        harness.connector.workers[1].pool.slot(ready)[0] ^= 0x40
        assert any("of rank 1 does not hold" in line for line in harness.violations())
    finally:
        harness.close()


def test_a_rank_process_checks_its_ready_slots_against_its_heads_and_its_tokens_against_rank_0() -> None:
    oracle = BlockOracle(TP_SHAPE, 1)
    device = SimDevice()
    config = OffloadConfig(cpu_blocks=2, gpu_block_size=TP_SHAPE.block_size, num_workers=2)
    rank = Rank(TP_SHAPE, 4, device, index=1, world=2, worker=WorkerConnector(config, device, worker=1))
    assert rank.worker is not None
    rank.worker.register_kv_caches(rank.kv_caches, "kv-first")
    prefix = (11, 12)
    command = Command(ready=(ReadySlot(slot=0, prefix=prefix),), tokens={})
    try:
        assert verify(rank, command, oracle.prefix_bytes) != [], "an empty slot passed for a stored one"
        rank.worker.pool.slot(0).copy_(oracle.prefix_bytes(prefix, rank.heads))
        assert verify(rank, command, oracle.prefix_bytes) == []
        assert verify(rank, Command(tokens={0: [6]}), oracle.prefix_bytes) != [], "rank 1 sampled nothing"
    finally:
        rank.worker.shutdown()


def test_a_connector_needs_one_device_per_worker() -> None:
    with pytest.raises(WorkerCountMismatch, match="2 devices with num_workers=1"):
        Connector(OffloadConfig(cpu_blocks=4), [SimDevice(), SimDevice()])


def test_heads_must_divide_among_the_ranks() -> None:
    with pytest.raises(HeadsDoNotDivide, match="3 heads do not divide among 2 ranks"):
        Engine(EngineConfig(model=ModelShape(num_heads=3)), [SimDevice(), SimDevice()])


def test_a_tensor_parallel_engine_computes_whole_forwards() -> None:
    with pytest.raises(LayerByLayerOnOneDevice):
        Engine(EngineConfig(model=TP_SHAPE, per_layer=True), [SimDevice(), SimDevice()])


def test_the_sharded_model_sums_to_the_unsharded_token() -> None:
    blocks, tokens = torch.tensor([0, 1]), torch.tensor([5, 6, 7, 8])
    whole = Rank(TP_SHAPE, 2, SimDevice())
    halves = [Rank(TP_SHAPE, 2, SimDevice(), index, 2) for index in range(2)]
    for rank in (whole, *halves):
        rank.model.write(blocks, tokens, 0)
    total = sum(half.model.partial_sum(blocks, 4) for half in halves)
    assert whole.model.token(whole.model.partial_sum(blocks, 4)) == whole.model.token(total)
    assert not torch.equal(halves[0].caches[0], halves[1].caches[0]), "both ranks wrote the same heads"
