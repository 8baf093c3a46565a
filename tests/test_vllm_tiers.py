"""The disk tier under vLLM's real Scheduler: the scheduler process decides every write-back and fetch, the adapter's
real worker role writes and reads the slot file, and a prefix the CPU pool evicted comes back disk -> CPU -> GPU with
its writer's bytes. Every run is traced against the spec, checked by the named invariants after every step (the
scheduler's tier indexes included) and required to drain. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import kvfsm.connector.tier_planner as tier_planner  # noqa: E402
import kvfsm.integrations.vllm.connector as connector_module  # noqa: E402
import kvfsm.integrations.vllm.worker_tiers as worker_tiers  # noqa: E402
from kvfsm.connector.metadata import LoadOrder  # noqa: E402
from kvfsm.connector.ranks import TierOutcome, every_rank_tier_outcome  # noqa: E402
from kvfsm.connector.tier_runner import TierRunner  # noqa: E402
from kvfsm.integrations.vllm import InvalidExtraConfig, KvfsmConnector, UnsupportedTier, WrongRole  # noqa: E402
from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.integrations.vllm.config import gpu_block_bytes, offload_config  # noqa: E402
from kvfsm.integrations.vllm.master_lookup import KeyScheme  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, kv_cache_config, vllm_config  # noqa: E402
from kvfsm.integrations.vllm.tier_index import ReportedTier  # noqa: E402
from kvfsm.integrations.vllm.worker_tiers import TierEvictions  # noqa: E402
from kvfsm.mooncake.keys import KvNamespace, head_key, object_key  # noqa: E402
from kvfsm.tier_records import TierJob  # noqa: E402
from kvfsm.tiers.disk import DiskIo  # noqa: E402
from vllm_harness import AdapterWorker, Driver, FakeRanks  # noqa: E402
from vllm_support import hold_disk_writes, loads_of, model  # noqa: E402,F401

pytestmark = pytest.mark.vllm

BLOCK_BYTES = gpu_block_bytes(kv_cache_config(1))
PREFIX = list(range(400, 400 + 4 * BLOCK_SIZE))
OTHERS = [list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * BLOCK_SIZE)) for i in range(3)]
"""Prefixes that push PREFIX out of an 8-block CPU pool."""
MAX_STEPS = 4000
"""Steps a test may take in all (the driver counts them across its runs): the tier's I/O runs on its own threads,
and vLLM steps idle, at CPU speed, until every rank reported it, so a busy machine takes hundreds of idle steps
per write-back or fetch (400 were seen to run out on a loaded 2-core machine). A job that never ends still fails."""


def disk_tier(path: Path, blocks: int = 64, **extra: Any) -> dict[str, Any]:
    return {"kind": "disk", "path": str(path), "capacity_bytes": blocks * BLOCK_BYTES, "writeback": "eager", **extra}


@pytest.fixture
def tiered(model, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Driver, list[AdapterWorker]]]]:
    """`tiered(tier, ranks=1, async_scheduling=False, kv_events=False)`: a driver over one lower tier and its real
    worker roles, one per tensor-parallel rank (each its own slot file; several ranks' outputs combined by vLLM's
    `KVOutputAggregator`). Each driver stops tracing and each worker closes its tiers when the test ends."""
    opened: list[tuple[Driver, list[AdapterWorker]]] = []

    def build(tier: dict[str, Any], ranks: int = 1, async_scheduling: bool = False, kv_events: bool = False
              ) -> tuple[Driver, list[AdapterWorker]]:
        config = vllm_config(model, {"cpu_blocks": 8, "lower_tiers": [tier]}, 64, tensor_parallel_size=ranks,
                             async_scheduling=async_scheduling)
        if kv_events:  # vLLM publishes KV events: the connector records them
            config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        workers = []
        for rank in range(ranks):
            monkeypatch.setattr(connector_module, "worker_rank", lambda world_size, rank=rank: rank)
            workers.append(AdapterWorker(config))
        driven = workers[0] if ranks == 1 else FakeRanks(workers)  # type: ignore[arg-type]
        opened.append((Driver(config, driven), workers))
        return opened[-1]

    yield build
    for d, workers in opened:
        d.close()
        d.connector.shutdown()
        for worker in workers:
            worker.close()


def push_below_cpu(d: Driver, workers: list[AdapterWorker], prefix: list[int] = PREFIX,
                   others: list[list[int]] = OTHERS, tag: str = "") -> None:
    """The writer stores `prefix` (written back below the CPU pool), `others` push it out of the CPU pool, vLLM's
    GPU cache forgets everything and every rank's GPU caches are zeroed: whatever a reader of `prefix` finds now came
    through the CPU pool from below it. `tag` keeps request ids apart when a test does this more than once."""
    d.add(f"{tag}writer", prefix + [1, 2, 3])
    d.run(MAX_STEPS)
    for i, other in enumerate(others):
        d.add(f"{tag}other{i}", other + [1])
        d.run(MAX_STEPS)
    kvfsm = d.connector.scheduler_side.kvfsm
    assert not any(h in kvfsm.manager.catalogue for h in prefix_keys(d, prefix)), "the CPU pool still holds it"
    d.reset_gpu_prefix_cache()
    for cache in (c for worker in workers for c in worker.caches.values()):
        cache.zero_()


def evict_from_cpu_then_reload(d: Driver, workers: list[AdapterWorker],
                               meanwhile: Callable[[], None] = lambda: None) -> list[LoadOrder]:
    """`push_below_cpu`, then `meanwhile` runs and a reader of the same prefix runs. Its loads."""
    push_below_cpu(d, workers)
    meanwhile()
    d.add("reader", PREFIX + [9])
    d.run(MAX_STEPS)
    return loads_of(d, "reader")


def prefix_keys(d: Driver, prefix: list[int]) -> list[int]:
    """The CPU-block keys of `prefix`'s full blocks, hashed as vLLM hashes a request's blocks."""
    request = Request("keys", prefix, SamplingParams(max_tokens=1), None, block_hasher=d.hasher)
    return [d.connector.scheduler_side.codec.to_int(h) for h in request.block_hashes]


def holds_prefix(worker: AdapterWorker, load: LoadOrder, prefix: list[int] = PREFIX) -> bool:
    """Every K and V value of every layer of each loaded block is the one its writer's forward pass wrote there (the
    token id at that position, mod 251): not one byte wrong."""
    for i, block in enumerate(load.gpu_blocks):
        tokens = torch.tensor([t % 251 for t in prefix[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]])
        for cache in worker.caches.values():
            written = cache[:, block]  # (K and V, positions, heads, head size)
            if not bool((written == tokens.view(1, -1, 1, 1).to(written.dtype)).all()):
                return False
    return True


def misplace_fetches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A control: every worker's tier reads each fetch's keys into the fetch's CPU slots in reverse order."""
    submit: Callable[..., None] = TierRunner.submit

    def misplaced(self: TierRunner, orders: Any) -> None:
        submit(self, [o.model_copy(update={"cpu_slots": o.cpu_slots[::-1]}) if o.kind == "fetch" else o
                      for o in orders])

    monkeypatch.setattr(TierRunner, "submit", misplaced)


def fetches(d: Driver) -> list[Any]:
    return [o for log in d.log for o in log.orders.tier_orders if o.kind == "fetch"]


def test_prefix_evicted_from_cpu_returns_from_disk_with_the_writers_bytes(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    (load,) = evict_from_cpu_then_reload(d, [worker])
    assert len(load.gpu_blocks) == len(PREFIX) // BLOCK_SIZE
    assert holds_prefix(worker, load)
    (fetch,) = fetches(d)
    assert fetch.tier == "disk" and list(fetch.keys) == prefix_keys(d, PREFIX)
    stats = d.connector.scheduler_side.kvfsm.tiers.stats
    assert stats.tokens_loaded_from["disk"] == len(PREFIX)
    assert stats.blocks_written_back["disk"] >= len(PREFIX) // BLOCK_SIZE
    assert d.cpu_pool_drained()


def test_under_async_scheduling_the_prefix_returns_from_disk_with_the_writers_bytes(tiered, tmp_path: Path) -> None:
    """vLLM schedules step N+1 before it reads step N's output: tier reports reach the index a step later."""
    d, (worker,) = tiered(disk_tier(tmp_path), async_scheduling=True)
    (load,) = evict_from_cpu_then_reload(d, [worker])
    assert holds_prefix(worker, load)
    assert d.connector.scheduler_side.kvfsm.tiers.stats.tokens_loaded_from["disk"] == len(PREFIX)


def test_control_a_fetch_that_lands_in_the_wrong_cpu_slots_is_caught_by_the_bytes(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    misplace_fetches(monkeypatch)
    d, (worker,) = tiered(disk_tier(tmp_path))
    (load,) = evict_from_cpu_then_reload(d, [worker])
    assert not holds_prefix(worker, load)


def test_control_a_worker_that_never_reports_its_tier_jobs_never_drains(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Today's adapter before the tiers were wired: a write-back nobody hears of pins its CPU slots for ever."""
    monkeypatch.setattr(TierRunner, "poll", lambda self: ())
    d, _ = tiered(disk_tier(tmp_path))
    d.add("writer", PREFIX + [1])
    with pytest.raises(AssertionError, match="not idle"):
        d.run(MAX_STEPS)


def test_control_an_index_that_offers_a_key_when_its_write_back_is_ordered_is_caught(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """publish-after-write across processes: the index offers a key before every rank reported writing it. The disk
    refuses every write, so the key is never written and the check cannot be outrun by a fast disk."""
    ordered = ReportedTier.ordered

    def eager(self: ReportedTier, job: TierJob) -> None:
        ordered(self, job)
        if job.kind == "write-back":
            for key in job.keys:
                self.entries.adopt(key)

    def refused(self: DiskIo, fd: int, parts: Any) -> None:
        raise OSError(errno.EIO, "the disk refuses every write")

    monkeypatch.setattr(ReportedTier, "ordered", eager)
    monkeypatch.setattr(DiskIo, "write", refused)
    d, _ = tiered(disk_tier(tmp_path))
    d.add("writer", PREFIX + [1])
    with pytest.raises(SpecViolation, match="publish-after-write.*no write-back of it ended on every rank"):
        d.run(MAX_STEPS)


def test_keys_a_full_disk_evicted_are_forgotten_by_the_scheduler(tiered, tmp_path: Path) -> None:
    """A disk of 4 blocks holds one prefix: writing the next evicts the first on the worker, and the scheduler's
    index, told by the worker's report, stops offering it (the reader recomputes, no fetch is ordered)."""
    d, (worker,) = tiered(disk_tier(tmp_path, blocks=4))
    d.add("writer", PREFIX + [1, 2, 3])
    d.run(MAX_STEPS)
    index = d.connector.scheduler_side.tier_index.tiers[0]
    keys = prefix_keys(d, PREFIX)
    assert index.lookup(keys) == len(keys)
    for i, other in enumerate(OTHERS):
        d.add(f"other{i}", other + [1])
        d.run(MAX_STEPS)
    assert index.lookup(keys) == 0
    assert len(index.entries) <= 4


def test_a_key_a_tier_evicted_and_holds_again_by_the_report_is_not_reported_evicted() -> None:
    """A key written again between its eviction and the worker's report is held: telling the scheduler's index to
    forget it would lose a block the tier serves."""
    gone, rewritten = SimpleNamespace(key=6), SimpleNamespace(key=5)
    tier = SimpleNamespace(name="disk", entries={5: SimpleNamespace(key=5), 6: gone})
    evictions = TierEvictions({"tier-entry": SimpleNamespace(observers=[])})  # type: ignore[arg-type]
    evictions.tiers = (tier,)  # type: ignore[assignment]
    for key in (5, 6):
        evictions("tier-entry", tier.entries[key], "published", "evict", "evicted")
    tier.entries = {5: rewritten}
    assert evictions.take() == (("disk", 6),)


def test_a_mooncake_tier_with_values_per_head_tells_the_scheduler_its_kv_heads() -> None:
    """The scheduler's master lookup names each head's value, so it must hear how many heads a block is split into;
    a tier with whole-block values says none."""
    namespace = KvNamespace(model_id="tiny@1", dtype="float16", layout="kv-first", block_tokens=16)
    per_head = SimpleNamespace(namespace=namespace, heads=SimpleNamespace(kv_heads=4))
    assert worker_tiers._scheme(per_head) == KeyScheme(namespace, 4)
    assert worker_tiers._scheme(SimpleNamespace(namespace=namespace, heads=None)) == KeyScheme(namespace, None)


def test_each_role_builds_only_its_own_half(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    assert (d.connector.role, worker.connector.role) == (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
    with pytest.raises(WrongRole):
        d.connector.worker_side  # noqa: B018
    assert worker.connector.get_kv_connector_stats() is None


def test_the_master_is_asked_for_each_heads_value_or_the_whole_blocks_in_the_tenants_names() -> None:
    namespace = KvNamespace(model_id="tiny@1", dtype="float16", layout="kv-first", block_tokens=16)
    assert KeyScheme(namespace, 2).names(5, "t") == [head_key(namespace, 5, 0, "t"), head_key(namespace, 5, 1, "t")]
    assert KeyScheme(namespace).names(5, "t") == [object_key(namespace, 5, "t")]
    assert object_key(namespace, 5, "t") not in (object_key(namespace, 5, None), object_key(namespace, 6, "t"))


def test_a_cache_reset_drops_the_keys_from_the_schedulers_index_at_once(tiered, tmp_path: Path) -> None:
    """Not only once the workers' tiers report them gone: a lookup in between would offer a fetch that fails."""
    d, _ = tiered(disk_tier(tmp_path))
    d.add("writer", PREFIX + [1, 2, 3])
    d.run(MAX_STEPS)
    index = d.connector.scheduler_side.tier_index.tiers[0]
    assert index.lookup(prefix_keys(d, PREFIX)) > 0
    d.reset_gpu_prefix_cache()
    assert d.connector.reset_cache()
    assert index.lookup(prefix_keys(d, PREFIX)) == 0


def test_cache_reset_drops_the_disk_tier_on_every_worker(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    d.add("writer", PREFIX + [1, 2, 3])
    d.run(MAX_STEPS)
    d.reset_gpu_prefix_cache()
    assert d.connector.reset_cache()
    d.step()
    (disk,) = worker.connector.worker_side.kvfsm.lower_tiers
    assert d.connector.scheduler_side.tier_index.tiers[0].lookup(prefix_keys(d, PREFIX)) == 0
    assert disk.lookup(prefix_keys(d, PREFIX)) == 0
    d.run(MAX_STEPS)


def corrupt_slot_file(worker: AdapterWorker) -> None:
    """Every byte of this rank's disk tier files overwritten: each block it reads fails its check."""
    (disk,) = worker.connector.worker_side.kvfsm.lower_tiers
    for block in (f for f in disk.directory.rglob("*") if f.is_file()):  # type: ignore[attr-defined]
        block.write_bytes(b"\xa5" * block.stat().st_size)


def test_with_two_ranks_each_fetches_its_own_share_from_its_own_file(tiered, tmp_path: Path) -> None:
    d, workers = tiered(disk_tier(tmp_path), ranks=2)
    (load,) = evict_from_cpu_then_reload(d, workers)
    assert all(holds_prefix(worker, load) for worker in workers)
    assert d.connector.scheduler_side.kvfsm.tiers.stats.tokens_loaded_from["disk"] == len(PREFIX)


def test_a_fetch_one_rank_failed_fails_on_both_and_the_prefix_is_recomputed(tiered, tmp_path: Path) -> None:
    d, workers = tiered(disk_tier(tmp_path), ranks=2)
    loads = evict_from_cpu_then_reload(d, workers, lambda: corrupt_slot_file(workers[1]))
    assert fetches(d) and not loads, "the reader loaded blocks rank 1 never fetched"
    stats = d.connector.scheduler_side.kvfsm.tiers.stats
    assert stats.failures["corrupt"] > 0 and stats.tokens_loaded_from["disk"] == 0
    assert "reader" in d.first_token and d.cpu_pool_drained()


def test_control_a_planner_that_hears_only_rank_zeros_failures_is_caught_and_loads_rank_ones_garbage(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Caught by `tier-job-every-rank`; with the checks silenced, the hazard: rank 1 loads bytes it never fetched."""
    def rank_zero_only(job: Any, num_workers: int) -> TierOutcome | None:
        outcome = every_rank_tier_outcome(job, num_workers)
        return None if outcome is None else TierOutcome(dict(job.reports[0].failed), outcome.held)

    monkeypatch.setattr(tier_planner, "every_rank_tier_outcome", rank_zero_only)
    d, workers = tiered(disk_tier(tmp_path), ranks=2)
    with pytest.raises(SpecViolation, match="tier-job-every-rank"):
        evict_from_cpu_then_reload(d, workers, lambda: corrupt_slot_file(workers[1]))
    d, workers = tiered(disk_tier(tmp_path / "silenced"), ranks=2)
    d.checks.violations = dict  # type: ignore[method-assign]
    (load,) = evict_from_cpu_then_reload(d, workers, lambda: corrupt_slot_file(workers[1]))
    assert holds_prefix(workers[0], load) and not holds_prefix(workers[1], load)


def test_a_write_back_in_flight_at_a_cache_reset_is_never_offered(tiered, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What it wrote is from before the reset: the index does not adopt it when it ends, and every worker's tier
    drops it (the stale write-back's keys are discarded in a later step's metadata). The disk's writes wait for the
    reset, so the write-back is in flight at it however fast the disk is."""
    reset = hold_disk_writes(monkeypatch)
    d, (worker,) = tiered(disk_tier(tmp_path))
    d.add("writer", PREFIX + [1, 2, 3])
    while not any(o.kind == "write-back" for log in d.log for o in log.orders.tier_orders):
        d.step()
    assert d.connector.scheduler_side.moving_between_tiers
    d.connector.reset_cache()
    reset.set()
    keys, index = prefix_keys(d, PREFIX), d.connector.scheduler_side.tier_index.tiers[0]
    offered: list[int] = []
    d.run(MAX_STEPS, after_step=lambda: offered.append(index.lookup(keys)))  # not even for a step in between
    (disk,) = worker.connector.worker_side.kvfsm.lower_tiers
    assert not any(offered) and disk.lookup(keys) == 0


def test_disk_tier_under_data_parallel_engines_is_refused_by_name(model, tmp_path: Path) -> None:
    config = vllm_config(model, {"cpu_blocks": 8, "lower_tiers": [disk_tier(tmp_path)]}, 64)
    config.parallel_config.data_parallel_size = 2
    with pytest.raises(UnsupportedTier, match="disk tier 'disk'.*2 data-parallel engines"):
        offload_config(config)
    named = vllm_config(model, {"cpu_blocks": 8, "lower_tiers": [
        disk_tier(tmp_path, model_id="tiny", kv_dtype="float16")]}, 64)
    named.parallel_config.data_parallel_size = 2
    assert offload_config(named).lower_tiers[0].model_id == "tiny"  # shared by design: allowed
    assert not list(tmp_path.iterdir())  # nothing opened


@pytest.mark.parametrize("tier, named", [
    ({"kind": "disk", "path": "/nonexistent", "capacity_bytes": 0}, "capacity_bytes"),
    ({"kind": "disk", "capacity_bytes": 1 << 20}, "path"),
    ({"kind": "tape", "path": "/tmp"}, "kind"),
    ({"kind": "disk", "path": "/tmp", "capacity_bytes": 1 << 20, "speed": 3}, "speed"),
])
def test_a_bad_tier_is_refused_at_start_up_naming_the_key(model, tier: dict[str, Any], named: str) -> None:
    config = vllm_config(model, {"cpu_blocks": 8, "lower_tiers": [tier]}, 64)
    with pytest.raises(InvalidExtraConfig, match=named):
        KvfsmConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(64))


def test_the_schedulers_tier_index_holds_cpu_blocks_and_moves_on_the_connectors_machines(model, tmp_path: Path) -> None:
    """The index is the planner's `LowerTier`: its blocks are CPU blocks (`block_size_factor` GPU blocks each), and
    its entries move on the connector's machines, so a trace or check of the connector sees each tier transition."""
    config = vllm_config(model, {"cpu_blocks": 8, "block_size_factor": 2, "lower_tiers": [disk_tier(tmp_path)]}, 64)
    connector = KvfsmConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(64))
    side = connector.scheduler_side
    (index,) = side.tier_index.tiers
    assert index.block_bytes == 2 * BLOCK_BYTES
    seen: list[str] = []
    side.kvfsm.machines.observe(lambda lifecycle, model, source, trigger, dest: seen.append(f"{lifecycle}.{trigger}"))
    index.entries.adopt(7)
    assert seen == ["tier-entry.adopt"]
    connector.shutdown()
