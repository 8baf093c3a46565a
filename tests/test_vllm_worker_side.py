"""The adapter worker's start-up rules that hang on the host rather than on vLLM's steps: which device it drives, which
rank it reports as, how replicated KV's ranks learn rank 0's region, when a worker makes a shared region at all, and
that a Mooncake tier counts as shared.

The process group and the tensor-parallel group are stood in for where a CPU test has none: `torch.distributed` as an
initialised group of a given rank, vLLM's tensor-parallel group as two ranks whose broadcast hands every rank what the
source rank passed (as vLLM's `GroupCoordinator.broadcast_object` does). Skipped when vLLM is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

import vllm.distributed.parallel_state as parallel_state  # noqa: E402

import kvfsm.integrations.vllm.worker_side as worker_side  # noqa: E402

from kvfsm.config import DiskTierConfig, LowerTierConfig  # noqa: E402
from kvfsm.executor.sim import SimDevice  # noqa: E402
from kvfsm.integrations.vllm.rig import model_config, vllm_config  # noqa: E402
from kvfsm.integrations.vllm.worker_side import default_device, region_path, worker_rank  # noqa: E402
from kvfsm.io_executor import IoExecutor  # noqa: E402
from kvfsm.machines import MachineSet  # noqa: E402
from kvfsm.tiers.base import LowerTier, TierSite  # noqa: E402
from kvfsm.tiers.factory import TIER_FACTORIES  # noqa: E402
from vllm_harness import AdapterWorker  # noqa: E402

pytestmark = pytest.mark.vllm


def test_a_host_without_cuda_drives_the_simulated_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(default_device(), SimDevice)


def test_a_host_with_cuda_drives_the_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether CUDA is there decides the device; the CUDA device itself is stood in for, as this host has none."""

    class StandInCuda(SimDevice):
        pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(worker_side, "CudaDevice", StandInCuda)
    assert isinstance(default_device(), StandInCuda)


def test_a_worker_reports_as_its_place_in_its_engine_when_torch_distributed_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Global rank 5 of data-parallel engines of 4 workers each is the second engine's worker 1."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 5)
    assert worker_rank(4) == 1


def test_a_worker_without_torch_distributed_reports_as_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 5)
    assert worker_rank(4) == 0


class _TwoRanks:
    """vLLM's tensor-parallel group of two ranks, one process: the source rank calls first, and each rank's
    broadcast returns what the source rank passed."""

    def __init__(self) -> None:
        self.sent: dict[int, object] = {}
        self.rank = 0

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        if self.rank == src:
            self.sent[src] = obj
            return obj
        return self.sent[src]


def test_every_rank_learns_rank_0s_region_path(monkeypatch: pytest.MonkeyPatch) -> None:
    group = _TwoRanks()
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    assert region_path("/dev/shm/kvfsm-region") == "/dev/shm/kvfsm-region"
    group.rank = 1
    assert region_path(None) == "/dev/shm/kvfsm-region"


def test_a_lone_worker_with_replicated_kv_registers_without_a_shared_region(tmp_path: Path) -> None:
    """Replicated KV with one vLLM worker has no rank to share a region with, and no tensor-parallel group to
    broadcast one over: the worker registers its own pool."""
    config = vllm_config(model_config(tmp_path), {"cpu_blocks": 16, "replicated": True}, 32)
    worker = AdapterWorker(config)
    assert worker.connector.worker_side.kvfsm.transfers is not None


def test_a_mooncake_tiers_namespace_goes_to_the_scheduler_as_a_shared_tiers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other engines write a Mooncake tier's store too, so the scheduler hears its namespace once the worker opens it.
    The tier itself is a private disk tier standing in (this host runs no Mooncake master)."""
    stand_in = DiskTierConfig(name="stand-in", path=tmp_path / "disk", capacity_bytes=1 << 20)

    def open_stand_in(config: LowerTierConfig, site: TierSite, io: IoExecutor | None, keep_lookups: bool,
                      machines: MachineSet) -> LowerTier:
        return TIER_FACTORIES["disk"](stand_in.model_copy(update={"name": config.name}), site, io, keep_lookups,
                                      machines)

    monkeypatch.setitem(TIER_FACTORIES, "mooncake", open_stand_in)
    mooncake = {"kind": "mooncake", "name": "mc", "master": "127.0.0.1:50051", "model_id": "m", "kv_dtype": "float16"}
    config = vllm_config(model_config(tmp_path), {"cpu_blocks": 16, "lower_tiers": [mooncake]}, 32)
    worker = AdapterWorker(config)
    meta = worker.connector.build_connector_worker_meta()
    assert meta is not None and [(name, rank) for name, rank, _ in meta.namespaces] == [("mc", 0)]
