"""The engine's ranks under tensor parallelism: each rank poisons the blocks its step allocated before its forward
pass, as the one-device engine does, so a read the ordering rules should have prevented shows on every rank; and
each rank's operations carry the step they belong to (what a violation's trace names)."""

from __future__ import annotations

import time

import pytest
import torch

from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import TP_SHAPE, Harness

FIRST_STEP = 1


def test_each_rank_poisons_its_new_blocks_and_labels_its_operations_with_the_step() -> None:
    harness = Harness([SimDevice(), SimDevice()], num_gpu_blocks=8, cpu_blocks=6, shape=TP_SHAPE)
    try:
        harness.add_request((11, 12, 13), 1)
        harness.drain()
        for rank in harness.engine.ranks.ranks:  # type: ignore[attr-defined]
            writes = {access.label for access in rank.device.accesses if access.mode == "write"}
            assert {f"poison step {FIRST_STEP}", f"compute step {FIRST_STEP}"} <= writes
    finally:
        harness.close()


def _cuda_ranks(replicated: bool, compute_delay_cycles: int = 0) -> Harness:
    """Ranks on this process's GPU: two kv-first ranks, or one rank holding replicated KV (the ranks' path either
    way, which a one-device engine without replication does not take)."""
    from kvfsm.executor.cuda import CudaDevice

    devices = CudaDevice() if replicated else [CudaDevice(), CudaDevice()]
    return Harness(devices, num_gpu_blocks=8, cpu_blocks=6, shape=TP_SHAPE, replicated=replicated,
                   compute_delay_cycles=compute_delay_cycles)


@pytest.mark.gpu
@pytest.mark.parametrize("replicated", [False, True], ids=["kv-first", "replicated"])
def test_each_ranks_kv_caches_live_on_its_gpu(replicated: bool) -> None:
    harness = _cuda_ranks(replicated)
    try:
        gpu = torch.device("cuda", torch.cuda.current_device())
        for rank in harness.engine.ranks.ranks:  # type: ignore[attr-defined]
            assert {t.device for t in [*rank.caches, *rank.kv_caches.values()]} == {gpu}
    finally:
        harness.close()


DELAY_CYCLES = 300_000_000
"""A compute delay no GPU runs in under 100 ms: SM clocks stay below 3 GHz."""


@pytest.mark.gpu
def test_a_ranks_compute_delay_holds_its_forward_pass_on_the_gpu() -> None:
    """The delay exists to widen the windows in which a load or store could overtake compute; dropped, the GPU race
    trials of tensor parallelism would test less than they say."""
    def drained_seconds(delay: int) -> float:
        harness = _cuda_ranks(replicated=False, compute_delay_cycles=delay)
        try:
            harness.add_request((11, 12, 13), 1)
            start = time.perf_counter()
            harness.drain()
            return time.perf_counter() - start
        finally:
            harness.close()

    drained_seconds(0)  # CUDA's first kernels load here, not in the runs compared
    assert drained_seconds(DELAY_CYCLES) - drained_seconds(0) >= DELAY_CYCLES / 3e9 / 2
