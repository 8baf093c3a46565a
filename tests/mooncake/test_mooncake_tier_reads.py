"""A Mooncake tier's reads, submitted to the tier itself on a real master: a key the tier does not hold fails
`missing` while the job's other keys still land, each read block comes back with the checksum it was first stored
with, a read in flight names its keys, and a job id already in flight is refused before anything is read."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from itertools import count

import pytest
import torch

pytest.importorskip("mooncake.store")

from kvfsm.bindings import default_spec  # noqa: E402
from kvfsm.config import MooncakeTierConfig, OffloadConfig  # noqa: E402
from kvfsm.engine.ranks import Rank  # noqa: E402
from kvfsm.executor import SimDevice  # noqa: E402
from kvfsm.executor.layouts import register_kv_caches  # noqa: E402
from kvfsm.executor.pool import HostPool  # noqa: E402
from kvfsm.machines import MachineSet  # noqa: E402
from kvfsm.tiers.base import TierFailure, TierMisuse, TierSite  # noqa: E402
from kvfsm.tiers.mooncake import MooncakeTier, open_mooncake  # noqa: E402
from test_mooncake_heads import FACTOR, SHAPE, completion  # noqa: E402

SLOTS = 3
STORED, ABSENT = 0x51, 0x52
CHECKSUM = 0xC0FFEE
JOB_IDS = count(1)


def open_tier(deployment, keep_lookups: bool = False, **options: object) -> tuple[MooncakeTier, HostPool]:
    """A tier over a pool of `SLOTS` slots on `deployment`, in a tenant of its own (`options`: its config's)."""
    settings: dict[str, object] = dict(master=str(deployment.address), model_id="kvfsm-toy",
                                       kv_dtype=str(SHAPE.dtype), tenant=uuid.uuid4().hex, op_timeout_s=60.0,
                                       lookup_timeout_s=10.0)
    config = MooncakeTierConfig(**(settings | options))  # type: ignore[arg-type]
    offload = OffloadConfig(cpu_blocks=SLOTS, block_size_factor=FACTOR, gpu_block_size=SHAPE.block_size,
                            lower_tiers=(config,))
    device = SimDevice()
    caches = register_kv_caches(Rank(SHAPE, 4, device, 0, 1).kv_caches, "kv-first")
    pool = HostPool(device, SLOTS, FACTOR * caches.gpu_block_bytes)
    opened = open_mooncake(config, TierSite(offload, pool.slot_bytes, 0, caches, pool), None, keep_lookups,
                           MachineSet(default_spec()))
    return opened, pool


@pytest.fixture
def tier(mooncake) -> Iterator[tuple[MooncakeTier, HostPool]]:
    """A tier over a pool of three slots, in a tenant of its own, holding `STORED` (slot 0's bytes, stored with
    `CHECKSUM`)."""
    opened, pool = open_tier(mooncake)
    pool.slot(0).copy_(torch.arange(pool.slot_bytes) % 251)
    job = next(JOB_IDS)
    opened.submit_write(job, [STORED], [view(pool, 0)], [CHECKSUM])
    assert completion(opened, job).ok
    yield opened, pool
    opened.close()


def view(pool: HostPool, slot: int) -> memoryview:
    return memoryview(pool.slot(slot).numpy())


def test_a_key_the_tier_does_not_hold_fails_missing_and_the_jobs_other_keys_still_land(tier) -> None:
    tier_, pool = tier
    pool.slot(2).fill_(0xA5)
    job = next(JOB_IDS)
    tier_.submit_read(job, [ABSENT, STORED], [view(pool, 1), view(pool, 2)])
    assert completion(tier_, job).failed == {ABSENT: TierFailure.missing}
    assert bool((pool.slot(2) == pool.slot(0)).all()), "the key after the missing one was not read"


def test_a_read_hands_back_the_checksum_each_block_was_first_stored_with(tier) -> None:
    tier_, pool = tier
    job = next(JOB_IDS)
    tier_.submit_read(job, [STORED], [view(pool, 1)])
    done = completion(tier_, job)
    assert done.ok and done.checksums == {STORED: CHECKSUM}


def test_a_read_in_flight_names_its_keys_until_it_is_reported(tier) -> None:
    """What `tier_invariants` counts as the readers of a key."""
    tier_, pool = tier
    job = next(JOB_IDS)
    tier_.submit_read(job, [STORED], [view(pool, 1)])
    assert tier_.reads_in_flight() == [STORED]
    assert completion(tier_, job).ok and tier_.reads_in_flight() == []


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_job_whose_id_is_in_flight_is_refused(tier, kind: str) -> None:
    tier_, pool = tier
    submit, key = (tier_.submit_read, STORED) if kind == "read" else (tier_.submit_write, ABSENT)
    job = next(JOB_IDS)
    submit(job, [key], [view(pool, 1)])
    with pytest.raises(TierMisuse, match=f"^mooncake tier 'mooncake': job {job} is already in flight$"):
        submit(job, [key], [view(pool, 2)])
    assert completion(tier_, job).ok
