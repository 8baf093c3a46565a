"""Replicated (MLA) KV through the Mooncake tier on a real master: a TP=2 engine's ranks share one host pool and
rank 0 alone writes each block back (`replicated-one-tier-move`); its keys name no rank or TP size, since a block
of replicated KV is every head's, so a TP=1 engine of the same MLA-shaped caches reloads it byte-exact, and the
reverse. The harness checks every slot and published value against the oracle's MLA bytes, and the outputs."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("mooncake.store")

from kvfsm.executor import SimDevice  # noqa: E402
from kvfsm.testing.harness import TP_SHAPE, Harness  # noqa: E402
from test_mooncake_tier import clean, from_store, serve  # noqa: E402

PROMPT = tuple(range(3, 3 + 8))


def mla_engine(mooncake, ranks: int, tenant: str) -> Harness:
    return Harness([SimDevice() for _ in range(ranks)], num_gpu_blocks=12, cpu_blocks=8, shape=TP_SHAPE,
                   replicated=True, checksum=True, mooncake_master=str(mooncake.address),
                   mooncake_options={"tenant": tenant})


@pytest.mark.parametrize(("writer", "reader"), [(2, 1), (1, 2)])
def test_replicated_kv_written_back_at_one_tp_size_is_reloaded_byte_exact_at_another(mooncake, writer: int,
                                                                                     reader: int) -> None:
    tenant = uuid.uuid4().hex
    first = mla_engine(mooncake, writer, tenant)
    serve(first, PROMPT)
    written = first.connector.scheduler.tiers.stats.blocks_written_back["mooncake"]  # type: ignore[union-attr]
    assert written > 0, "nothing was written back"
    assert all(report.moved == (rank == 0) for job in first.world.tier_jobs.values()
               for rank, report in job.reports.items()), "a rank other than rank 0 moved a write-back"
    clean(first)
    second = mla_engine(mooncake, reader, tenant)
    serve(second, PROMPT)
    assert from_store(second) > 0, f"a TP={reader} engine recomputed what a TP={writer} engine wrote back"
    clean(second)  # every slot of every rank holds the oracle's MLA bytes; the outputs are the unsharded model's
