"""Replicated (MLA) KV under vLLM's real Scheduler: the adapter's real worker roles of a TP=2 engine (SimDevices, their
outputs combined by vLLM's `KVOutputAggregator`) whose model vLLM takes for MLA. With `replicated` the two ranks
share one host pool (a `/dev/shm` region rank 0 makes and sends the path of, as over vLLM's tensor-parallel group),
each store is copied once, and both ranks reload the writer's bytes; without it each rank stores its own copy (the
control: twice the slot writes), which the start-up log says. Where the ranks' KV is not one (not MLA, pipeline
stages, a lower tier beside it) `replicated` is refused at start-up by name. Skipped when vLLM is not installed."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("vllm")

import kvfsm.integrations.vllm.connector as connector_module  # noqa: E402
from kvfsm.integrations.vllm import worker_side  # noqa: E402
from kvfsm.integrations.vllm.config import ReplicatedNotServed, offload_config  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, vllm_config  # noqa: E402
from kvfsm.integrations.vllm.worker_side import SharedRegionNotMade  # noqa: E402
from test_replicated_kv import slot_writes  # noqa: E402
from vllm_harness import AdapterWorker, Driver, FakeRanks  # noqa: E402
from vllm_support import model  # noqa: E402,F401  (the tiny model fixture)

pytestmark = pytest.mark.vllm

PREFIX = list(range(300, 300 + 3 * BLOCK_SIZE))
REPLICATED = {"cpu_blocks": 16, "replicated": True}


@pytest.fixture
def mla(model, monkeypatch: pytest.MonkeyPatch):
    """The tiny model, taken by vLLM for an MLA model: the harness's ranks write the same bytes anyway."""
    monkeypatch.setattr(type(model), "use_mla", property(lambda self: True))
    return model


def adapter_ranks(config: Any, monkeypatch: pytest.MonkeyPatch, sent: Callable[[str | None], str | None]
                  ) -> list[AdapterWorker]:
    """The two ranks' worker roles, built in rank order as vLLM's start-up meets in the broadcast: `sent` stands
    for it (rank 0 passes its region's path, the others receive it)."""
    monkeypatch.setattr(worker_side, "region_path", sent)
    workers = []
    for rank in range(2):
        monkeypatch.setattr(connector_module, "worker_rank", lambda world_size, rank=rank: rank)
        workers.append(AdapterWorker(config))
    return workers


@pytest.fixture
def two_ranks(mla, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict], tuple[Driver, list]]]:
    opened: list[tuple[Driver, list[AdapterWorker]]] = []

    def build(extra: dict) -> tuple[Driver, list[AdapterWorker]]:
        config = vllm_config(mla, extra, 32, tensor_parallel_size=2)
        box: dict[str, str | None] = {}
        workers = adapter_ranks(config, monkeypatch, lambda path: box.setdefault("path", path))
        opened.append((Driver(config, FakeRanks(workers)), workers))  # type: ignore[arg-type]
        return opened[-1]

    yield build
    for d, workers in opened:
        d.close()
        for worker in workers:
            worker.close()


@pytest.mark.parametrize("extra, copies", [(REPLICATED, 1), ({"cpu_blocks": 16}, 2)], ids=["replicated", "control"])
def test_two_mla_ranks_store_once_into_the_pool_they_share_and_both_reload_the_writers_bytes(
        two_ranks, extra: dict, copies: int) -> None:
    d, workers = two_ranks(extra)
    d.add("writer", PREFIX + [1])
    d.run()
    d.reset_gpu_prefix_cache()
    for worker in workers:
        for cache in worker.caches.values():
            cache.zero_()  # whatever the reader finds now came from the CPU pool
    d.add("reader", PREFIX + [2])
    d.run()
    (load,) = [o for log in d.log for o in log.orders.loads if o.req_id == "reader"]
    for worker in workers:
        for i, block in enumerate(load.gpu_blocks):
            assert worker.block_tokens(block) == [t % 251 for t in PREFIX[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]
    stored = sum(len(o.cpu_slots) for log in d.log for o in log.orders.stores)
    writes = [slot_writes(worker.connector.worker_side.device) for worker in workers]
    assert stored > 0 and sum(writes) == copies * stored, f"slot writes by rank {writes} for {stored} slots stored"
    pools = [worker.connector.worker_side.kvfsm.pool for worker in workers]
    pools[0].buffer[:8].fill_(0x5A)
    assert (pools[1].buffer[:8] == 0x5A).all() == (copies == 1), "one memory exactly when replicated"
    assert d.cpu_pool_drained()


def test_an_mla_model_at_tp2_without_replicated_is_logged_as_storing_a_copy_per_rank(
        mla, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvfsm.integrations.vllm.config"):
        offload_config(vllm_config(mla, {"cpu_blocks": 16}, 32))
        offload_config(vllm_config(mla, REPLICATED, 32, tensor_parallel_size=2))
        assert not caplog.records, "one rank, or one shared copy: nothing to say"
        offload_config(vllm_config(mla, {"cpu_blocks": 16}, 32, tensor_parallel_size=2))
    assert [r.getMessage() for r in caplog.records] == [
        "kvfsm: MLA KV over 2 vLLM workers: every rank stores its own copy of the same latent (2 times the PCIe "
        "bytes and host pool of one copy); replicated=true stores one, shared by the ranks"]


DISK = {"kind": "disk", "path": "/tmp/kvfsm-unused", "capacity_bytes": 1 << 20}


@pytest.mark.parametrize("is_mla, extra, parallel, why", [
    (False, REPLICATED, {"tensor_parallel_size": 2}, "the model is not MLA"),
    (True, REPLICATED, {"pipeline_parallel_size": 2}, "2 workers are not 1 tensor-parallel ranks"),
    (True, {**REPLICATED, "lower_tiers": [DISK]}, {"tensor_parallel_size": 2}, "lower tiers with replicated KV"),
], ids=["not-mla", "pipeline-stages", "lower-tier"])
def test_replicated_where_the_ranks_kv_is_not_one_is_refused_by_name_at_start_up(
        model, monkeypatch: pytest.MonkeyPatch, is_mla: bool, extra: dict, parallel: dict, why: str) -> None:
    monkeypatch.setattr(type(model), "use_mla", property(lambda self: is_mla))
    with pytest.raises(ReplicatedNotServed, match=why):
        offload_config(vllm_config(model, extra, 32, **parallel))


def test_replicated_refused_for_every_reason_at_once_names_each_in_full(model, monkeypatch: pytest.MonkeyPatch
                                                                          ) -> None:
    """Not MLA, pipeline stages, decode-context parallelism of 2, two nodes and a lower tier: each reason, in order."""
    monkeypatch.setattr(type(model), "use_mla", property(lambda self: False))
    config = vllm_config(model, {**REPLICATED, "lower_tiers": [DISK]}, 32, tensor_parallel_size=2,
                         pipeline_parallel_size=2)
    monkeypatch.setattr(config.parallel_config, "decode_context_parallel_size", 2)
    monkeypatch.setattr(type(config.parallel_config), "nnodes_within_dp", property(lambda self: 2))
    with pytest.raises(ReplicatedNotServed) as refused:
        offload_config(config)
    assert str(refused.value) == (
        "kv_connector_extra_config sets replicated=true with 4 vLLM workers, but the model is not MLA: each rank holds "
        "its own heads' KV; 4 workers are not 2 tensor-parallel ranks (pipeline or prefill-context parallelism: the "
        "ranks hold different layers or tokens); decode-context parallelism (2) splits the KV by tokens; the engine "
        "spans 2 nodes, and a host region is one host's; lower tiers with replicated KV are not served under vLLM yet")


def test_a_rank_whose_rank_0_made_no_shared_region_refuses_by_name(mla, monkeypatch: pytest.MonkeyPatch) -> None:
    config = vllm_config(mla, REPLICATED, 32, tensor_parallel_size=2)
    monkeypatch.setattr(worker_side, "region_path", lambda path: None)  # rank 0 failed and sent no path
    monkeypatch.setattr(connector_module, "worker_rank", lambda world_size: 1)
    with pytest.raises(SharedRegionNotMade) as refused:
        AdapterWorker(config)
    assert str(refused.value) == ("worker 1: rank 0 could not make the host region the ranks share (replicated KV); "
                                  "its error says why")
