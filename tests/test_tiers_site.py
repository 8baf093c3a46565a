"""Where a tier is opened (`TierSite`): the namespace a stored block is named by says how its bytes are laid out
and which shard of the KV it is, so engines that would read other bytes never find it."""

from __future__ import annotations

import pytest
import torch

from kvfsm.config import OffloadConfig
from kvfsm.executor import SimDevice
from kvfsm.executor.layouts import allocate_kv_caches, register_kv_caches
from kvfsm.executor.pool import HostPool
from kvfsm.tiers.base import TierSite, layout_of

WORKER = 1


def site(replicated: bool) -> TierSite:
    """Worker 1 of 2, its caches two groups of one layer each."""
    tensors, groups = allocate_kv_caches("kv-first", 2, 2, 2, 2, 2, torch.float16, "cpu", num_groups=2)
    caches = register_kv_caches(tensors, "kv-first", groups)
    pool = HostPool(SimDevice(), 1, caches.gpu_block_bytes)
    offload = OffloadConfig(cpu_blocks=1, gpu_block_size=2, num_workers=2, replicated=replicated)
    return TierSite(offload, pool.slot_bytes, WORKER, caches, pool)


def test_the_layout_names_every_groups_layout_then_every_planes_pieces_and_offset() -> None:
    assert layout_of(site(False).caches) == "group0=kv-first,group1=kv-first;layer0:2x16@0,layer1:2x16@32"


@pytest.mark.parametrize(("replicated", "rank", "world"), [(False, WORKER, 2), (True, 0, 1)])
def test_a_block_is_named_by_its_shard_and_replicated_kv_as_the_one_shard_of_one(replicated: bool, rank: int,
                                                                                  world: int) -> None:
    namespace = site(replicated).namespace("model", "float16")
    assert (namespace.tp_rank, namespace.tp_world_size) == (rank, world)
