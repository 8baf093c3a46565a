"""Opening a disk tier from the configuration: what the config and the site say reaches the tier (the worker's
rank names a private directory, the lookup bound a shared tier waits, the I/O threads and their name)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfsm.config import DiskTierConfig, MooncakeTierConfig, OffloadConfig
from kvfsm.executor import SimDevice
from kvfsm.executor.layouts import allocate_kv_caches, register_kv_caches
from kvfsm.executor.pool import HostPool
from kvfsm.machines import default_machines
from kvfsm.tiers import factory
from kvfsm.tiers.base import TierSite
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.io import ManualIo

WORKER = 1


def opened(config: DiskTierConfig) -> DiskTier:
    caches = register_kv_caches(allocate_kv_caches("kv-first", 1, 2, 2, 2, 2, torch.float16, "cpu")[0], "kv-first")
    pool = HostPool(SimDevice(), 1, caches.gpu_block_bytes)
    offload = OffloadConfig(cpu_blocks=1, gpu_block_size=2, num_workers=2, lower_tiers=(config,))
    [tier] = factory.open_tiers(TierSite(offload, pool.slot_bytes, WORKER, caches, pool), None, False,
                                default_machines())
    assert isinstance(tier, DiskTier)
    return tier


def test_a_private_disk_tier_is_named_by_its_workers_rank_and_runs_on_its_configured_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[int, str]] = []
    real = factory.io_threads
    monkeypatch.setattr(factory, "io_threads", lambda count, tier: asked.append((count, tier)) or real(count, tier))
    tier = opened(DiskTierConfig(name="cold", path=tmp_path, capacity_bytes=1 << 20, io_threads=3))
    try:
        assert tier.directory == tmp_path / f"private-cold-{WORKER}"
        assert asked == [(3, "cold")]
    finally:
        tier.close()


def test_a_shared_disk_tier_waits_its_configured_bound_for_a_lookup(tmp_path: Path) -> None:
    tier = opened(DiskTierConfig(path=tmp_path, capacity_bytes=1 << 20, model_id="m", kv_dtype="float16",
                                 lookup_timeout_s=0.25))
    try:
        assert tier._lookups is not None and tier._lookups.timeout_s == 0.25
    finally:
        tier.close()


def test_a_disk_tier_waits_its_configured_io_deadline(tmp_path: Path) -> None:
    tier = opened(DiskTierConfig(path=tmp_path, capacity_bytes=1 << 20, io_timeout_s=7.5))
    try:
        assert tier.io_timeout_s == 7.5
    finally:
        tier.close()


def test_a_mooncake_tier_gets_the_io_made_for_its_config_and_the_lookup_history_flag(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvfsm.tiers.mooncake as mooncake

    config = MooncakeTierConfig(master="localhost:1", model_id="m", kv_dtype="float16")
    io = ManualIo()
    asked: list[object] = []
    monkeypatch.setattr(mooncake, "open_mooncake", lambda *args: asked.append(args) or "tier")
    offload = OffloadConfig(cpu_blocks=1, gpu_block_size=2, lower_tiers=(config,))
    site = TierSite(offload, 1, 0, None, None)  # type: ignore[arg-type]  # the stand-in opener reads neither
    assert factory.open_tiers(site, {config: io}.get, True, default_machines()) == ("tier",)
    assert [(c, i, keep) for c, _, i, keep, _ in asked] == [(config, io, True)]  # type: ignore[misc]
