"""Shared-tier values any TP size of one model reads (`kv_heads`: one value per KV head, `kvfsm.mooncake.heads`), on
a real master: a prefix one engine's ranks wrote back is a whole hit for an engine of another TP size, whose ranks
each load exactly their heads' bytes of it (the oracle's); engines of another model, dtype or tenant miss it; and
the reference engine serves through per-head values with every check holding.

Each "engine" here is its ranks' Mooncake tiers, opened as each rank's worker half opens its own (`open_mooncake`
over the rank's registered caches and pool); the ranks of one engine are in this process, since what crosses
between them is only the store."""

from __future__ import annotations

import time
import uuid
from itertools import count

import pytest
import torch

pytest.importorskip("mooncake.store")

from kvfsm.bindings import default_spec  # noqa: E402
from kvfsm.config import MooncakeTierConfig, OffloadConfig  # noqa: E402
from kvfsm.engine.model import ModelShape  # noqa: E402
from kvfsm.engine.oracle import BlockOracle  # noqa: E402
from kvfsm.engine.ranks import Rank  # noqa: E402
from kvfsm.executor import SimDevice  # noqa: E402
from kvfsm.executor.layouts import allocate_kv_caches, register_kv_caches  # noqa: E402
from kvfsm.executor.pool import HostPool  # noqa: E402
from kvfsm.machines import MachineSet  # noqa: E402
from kvfsm.mooncake.heads import HeadsDoNotSplit, HeadSplit  # noqa: E402
from kvfsm.testing.harness import TP_SHAPE, Harness  # noqa: E402
from kvfsm.tiers.base import TierCompletion, TierFailure, TierSite  # noqa: E402
from kvfsm.tiers.mooncake import MooncakeTier, head_layout_of, open_mooncake  # noqa: E402
from test_mooncake_tier import from_store, serve  # noqa: E402

SHAPE = ModelShape(num_layers=2, num_heads=4, head_dim=4, block_size=2, vocab=997)
"""Four KV heads: TP=1, 2 and 4 all hold whole heads."""
FACTOR = 2
"""A CPU block of two GPU blocks: rows of several GPU blocks, layers and K/V."""
PREFIX = tuple(range(40, 40 + FACTOR * SHAPE.block_size))
BLOCK_HASH = 0x7E57
IO_BUDGET_S = 30.0
ORACLE = BlockOracle(SHAPE, FACTOR)
JOB_IDS = count(1)


class TpEngine:
    """The Mooncake tiers of one engine's `world` ranks, each over its own one-slot CPU pool."""

    def __init__(self, mooncake, world: int, tenant: str, **options: object) -> None:
        settings: dict[str, object] = dict(master=str(mooncake.address), model_id="kvfsm-toy",
                                           kv_dtype=str(SHAPE.dtype), tenant=tenant, kv_heads=SHAPE.num_heads,
                                           op_timeout_s=60.0, lookup_timeout_s=10.0)  # a busy CI machine is no miss
        config = MooncakeTierConfig(**(settings | options))  # type: ignore[arg-type]
        offload = OffloadConfig(cpu_blocks=1, block_size_factor=FACTOR, gpu_block_size=SHAPE.block_size,
                                num_workers=world, lower_tiers=(config,))
        machines = MachineSet(default_spec())
        self.ranks: list[tuple[Rank, MooncakeTier, HostPool]] = []
        for index in range(world):
            device = SimDevice()
            rank = Rank(SHAPE, 4, device, index, world)
            caches = register_kv_caches(rank.kv_caches, "kv-first")
            pool = HostPool(device, 1, FACTOR * caches.gpu_block_bytes)
            tier = open_mooncake(config, TierSite(offload, pool.slot_bytes, index, caches, pool), None, False,
                                 machines)
            self.ranks.append((rank, tier, pool))

    def write_back(self, prefix: tuple[int, ...], block_hash: int) -> None:
        """Every rank writes its heads' bytes of the block that ends `prefix` (the oracle's) under `block_hash`."""
        for rank, tier, pool in self.ranks:
            pool.slot(0).copy_(ORACLE.prefix_bytes(prefix, rank.heads))
            assert finish(tier, "write", block_hash, pool).ok

    def hits(self, block_hash: int) -> bool:
        """Whether every rank's lookup finds the whole block in the store (each rank adopts the key in its own tier,
        as its fetch needs)."""
        return all(tier.lookup([block_hash]) == 1 for _, tier, _ in self.ranks)

    def fetch(self, block_hash: int) -> list[torch.Tensor]:
        """Each rank's slot after it fetched `block_hash` (poisoned first: every byte must have landed)."""
        slots = []
        for _, tier, pool in self.ranks:
            pool.slot(0).fill_(0xA5)
            assert finish(tier, "read", block_hash, pool).ok
            slots.append(pool.slot(0).clone())
        return slots

    def close(self) -> None:
        for _, tier, _ in self.ranks:
            tier.close()


def finish(tier: MooncakeTier, kind: str, block_hash: int, pool: HostPool) -> TierCompletion:
    job = next(JOB_IDS)
    view = memoryview(pool.slot(0).numpy())
    (tier.submit_write if kind == "write" else tier.submit_read)(job, [block_hash], [view])
    return completion(tier, job)


def completion(tier: MooncakeTier, job: int) -> TierCompletion:
    """The tier's report of `job`, polled for up to `IO_BUDGET_S`."""
    deadline = time.monotonic() + IO_BUDGET_S
    while time.monotonic() < deadline:
        done = [c for c in tier.poll() if c.job_id == job]
        if done:
            return done[0]
        time.sleep(0.002)
    raise AssertionError(f"job {job} did not finish")


@pytest.fixture
def tenant() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def engines(mooncake, tenant):
    opened: list[TpEngine] = []

    def open_(world: int, **options: object) -> TpEngine:
        opened.append(TpEngine(mooncake, world, options.pop("tenant", tenant), **options))  # type: ignore[arg-type]
        return opened[-1]

    yield open_
    for each in opened:
        each.close()


@pytest.mark.parametrize(("writer", "reader"), [(2, 1), (2, 4), (1, 2), (4, 2), (4, 1), (1, 4)])
def test_a_block_written_back_at_one_tp_size_is_a_byte_exact_hit_at_another(engines, writer: int,
                                                                            reader: int) -> None:
    engines(writer).write_back(PREFIX, BLOCK_HASH)
    readers = engines(reader)
    assert readers.hits(BLOCK_HASH), f"a TP={reader} engine missed what a TP={writer} engine wrote back"
    for (rank, _, _), slot in zip(readers.ranks, readers.fetch(BLOCK_HASH)):
        assert torch.equal(slot, ORACLE.prefix_bytes(PREFIX, rank.heads)), f"rank {rank.index} of TP={reader}"


def test_a_block_some_heads_of_which_were_never_written_is_a_miss_at_every_tp_size(engines) -> None:
    """One rank of a TP=2 engine wrote its heads, the other did not: the block is not whole in the store."""
    writer = engines(2)
    rank, tier, pool = writer.ranks[0]
    pool.slot(0).copy_(ORACLE.prefix_bytes(PREFIX, rank.heads))
    assert finish(tier, "write", BLOCK_HASH, pool).ok
    assert not engines(1).hits(BLOCK_HASH) and not engines(4).hits(BLOCK_HASH)


def test_a_fetch_one_head_value_of_which_is_corrupted_fails_and_lands_no_head_in_its_slot(engines) -> None:
    engines(2).write_back(PREFIX, BLOCK_HASH)
    reader = engines(1)
    assert reader.hits(BLOCK_HASH)
    _, tier, pool = reader.ranks[0]
    store, name = tier.client.raw(), tier.store_keys(BLOCK_HASH)[3]  # the last head: the others check out
    spoiled = bytearray(store.get(name))
    spoiled[0] ^= 0xFF
    assert store.remove(name, True) == 0 and store.put(name, bytes(spoiled)) == 0
    pool.slot(0).fill_(0xA5)
    assert finish(tier, "read", BLOCK_HASH, pool).failed == {BLOCK_HASH: TierFailure.corrupt}
    assert bool((pool.slot(0) == 0xA5).all()), "the heads that checked out landed in the slot of a failed fetch"


@pytest.mark.parametrize("difference", ["model", "dtype", "tenant"])
def test_engines_of_another_model_dtype_or_tenant_miss_per_head_values(engines, difference: str) -> None:
    engines(2).write_back(PREFIX, BLOCK_HASH)
    other = {"model": {"model_id": "another-model"}, "dtype": {"kv_dtype": "float16"},
             "tenant": {"tenant": uuid.uuid4().hex}}[difference]
    assert engines(2).hits(BLOCK_HASH), "the control: the same engine hits"
    assert not engines(1, **other).hits(BLOCK_HASH)


def test_control_per_rank_values_written_at_one_tp_size_miss_at_another(engines) -> None:
    """Without `kv_heads` a key names the rank and TP size: what the test above shares is a miss here."""
    engines(2, kv_heads=None).write_back(PREFIX, BLOCK_HASH)
    assert engines(2, kv_heads=None).hits(BLOCK_HASH), "the control of the control: the same TP size hits"
    assert not engines(1, kv_heads=None).hits(BLOCK_HASH)


def test_per_head_and_per_rank_values_never_share_keys(engines, mooncake, tenant) -> None:
    """An engine without `kv_heads` (one value per rank's block) misses what per-head engines wrote, and the
    reverse: the two value layouts differ, so must their keys."""
    engines(1).write_back(PREFIX, BLOCK_HASH)
    assert not engines(1, kv_heads=None).hits(BLOCK_HASH)


def test_kv_heads_on_a_layout_without_heads_is_refused_by_name_at_open(mooncake, tenant) -> None:
    device = SimDevice()
    caches = register_kv_caches({"layer.0": torch.zeros(4, SHAPE.block_size, 8)}, "mla")
    pool = HostPool(device, 1, caches.gpu_block_bytes)
    config = MooncakeTierConfig(master=str(mooncake.address), model_id="m", kv_dtype="float32", kv_heads=4)
    offload = OffloadConfig(cpu_blocks=1, gpu_block_size=SHAPE.block_size, lower_tiers=(config,))
    with pytest.raises(HeadsDoNotSplit, match="mla"):
        open_mooncake(config, TierSite(offload, pool.slot_bytes, 0, caches, pool), None, False,
                      MachineSet(default_spec()))


def test_kv_heads_over_layers_of_unequal_rows_is_refused_by_name_at_open(mooncake, tenant) -> None:
    """A head's value is one row of every layer: layers whose K and V rows differ in width have no such row."""
    device = SimDevice()
    caches = register_kv_caches({"layer.0": torch.zeros(2, 4, SHAPE.block_size, 2, 4),
                                 "layer.1": torch.zeros(2, 4, SHAPE.block_size, 4, 4)}, "kv-first")
    pool = HostPool(device, 1, caches.gpu_block_bytes)
    config = MooncakeTierConfig(master=str(mooncake.address), model_id="m", kv_dtype="float32", kv_heads=4)
    offload = OffloadConfig(cpu_blocks=1, gpu_block_size=SHAPE.block_size, lower_tiers=(config,))
    refusal = f"^layers whose blocks are not K and V of {SHAPE.block_size} equal rows$"
    with pytest.raises(HeadsDoNotSplit, match=refusal):
        open_mooncake(config, TierSite(offload, pool.slot_bytes, 0, caches, pool), None, False,
                      MachineSet(default_spec()))


def test_an_engine_storing_one_value_per_head_serves_and_reloads_with_every_check_holding(mooncake,
                                                                                         tenant) -> None:
    """The reference engine (TP=1, two heads) through per-head values: stored, then loaded by a second engine;
    the harness checks every published key holds its prefix's bytes, reassembled from its heads' values."""
    prompt = tuple(range(3, 3 + 16))
    for _ in range(2):
        harness = Harness(SimDevice(), num_gpu_blocks=12, cpu_blocks=8, shape=TP_SHAPE,
                          mooncake_master=str(mooncake.address),
                          mooncake_options={"tenant": tenant, "kv_heads": TP_SHAPE.num_heads})
        serve(harness, prompt)
        assert harness.final_violations() == []
        loaded = from_store(harness)
        harness.close()
    assert loaded > 0, "the second engine recomputed what the first stored"


def test_the_per_head_layout_names_each_groups_layout_and_each_layers_pieces_in_a_fixed_form() -> None:
    """The layout is part of every per-head value's key: engines share values only if their groups' layouts,
    layers, head width and KV heads agree, and the same caches give the same words in another process or a later
    kvfsm (a change of the form bumps the key scheme)."""
    caches, groups = allocate_kv_caches("kv-first", 2, 2, 2, 2, 2, torch.float16, "cpu", num_groups=2)
    layout = head_layout_of(register_kv_caches(caches, "kv-first", groups), HeadSplit(2, 0, 2, 4, 64))
    assert layout == "per-head;group0=kv-first,group1=kv-first;layer0:2,layer1:2;head_bytes=4;kv_heads=2"
