"""Back-pressure under vLLM's real Scheduler: stores that fall behind are shed by a bound instead of piling up.

Two ways stores fall behind: the copy engines (a worker that reports each store many steps after its order) and a
lower tier (a disk whose writes do not return while the requests run). With the bound configured the stores in flight
and the tier's queue stay within it step after step, the shed blocks show in vLLM's `/metrics` as
`kvfsm_store_shed_total{tier=...}`, every run is traced against the spec, checked by the named invariants after every
step (`stores-bounded`, `writeback-queue-bounded` among them) and drains. The control of each is the same run without
the bound, which the same bound check catches growing past it. Skipped when vLLM is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvfsm.integrations.vllm import InvalidExtraConfig, KvfsmConnector  # noqa: E402
from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.integrations.vllm.config import gpu_block_bytes  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker, kv_cache_config, vllm_config  # noqa: E402
from kvfsm.testing.mutants import bound_per_store  # noqa: E402
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import hold_disk_writes, make_driver, model, scraped  # noqa: E402,F401

pytestmark = pytest.mark.vllm

PROMPTS = [list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * BLOCK_SIZE)) + [7] for i in range(4)]
"""Four prompts of four full blocks each, arriving together: sixteen blocks to store in the same few steps."""
BOUND = 4
MAX_STEPS = 4000
"""As in test_vllm_tiers: vLLM steps idle at CPU speed while the disk's threads work."""


class Peak:
    """The largest value `measure` took after any step: what the bound check reads."""

    def __init__(self, measure: Callable[[], int]) -> None:
        self.measure, self.value = measure, 0

    def __call__(self) -> None:
        self.value = max(self.value, self.measure())


def shed(registry: CollectorRegistry, tier: str) -> float | None:
    return registry.get_sample_value("kvfsm_store_shed_total", {"model_name": "tiny", "engine": "0", "tier": tier})


# the copy engines fall behind ------------------------------------------------------------------------------


def slow_copies(make_driver: Callable[..., Driver], **extra: Any) -> tuple[Driver, Peak]:
    """Every store reported 8 steps after its order; the four prompts run to the end. The peak of the CPU blocks
    of stores in flight."""
    d = make_driver(FakeWorker(store_steps=8), cpu_blocks=32, **extra)
    peak = Peak(lambda: d.connector.scheduler_side.kvfsm.ledger.store_blocks_in_flight)
    for i, prompt in enumerate(PROMPTS):
        d.add(f"r{i}", prompt)
    d.run(200, after_step=peak)
    return d, peak


def test_stores_the_copy_engines_fall_behind_on_are_shed_at_the_bound(make_driver) -> None:
    d, peak = slow_copies(make_driver, store_max_blocks_in_flight=BOUND)
    stats = d.connector.scheduler_side.kvfsm.stats
    assert 0 < peak.value <= BOUND
    assert stats.store_shed["cpu"] == len(PROMPTS) * 4 - stats.blocks_stored > 0
    assert shed(scraped(d), "cpu") == stats.store_shed["cpu"]


def test_control_without_a_bound_the_stores_in_flight_grow_past_it(make_driver) -> None:
    _, peak = slow_copies(make_driver)
    assert peak.value > BOUND, "the same run without a bound should pile stores up: the bound check would see it"


def test_control_a_bound_per_store_is_caught_by_stores_bounded(make_driver) -> None:
    d = make_driver(FakeWorker(store_steps=8), cpu_blocks=32, store_max_blocks_in_flight=BOUND)
    bound_per_store(d.connector.scheduler_side.kvfsm)
    for i, prompt in enumerate(PROMPTS):
        d.add(f"r{i}", prompt)
    with pytest.raises(SpecViolation, match="stores-bounded"):
        d.run(200)


# a lower tier falls behind ---------------------------------------------------------------------------------


@pytest.fixture
def held_disk(model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Driver, Peak]]]:
    """`held_disk(queue_blocks)`: a driver over an eager disk tier whose writes wait until every request finished
    (a saturated tier), one write-back in flight at a time; the requests run to the end and the disk then catches
    up. The peak of the tier's queue of blocks waiting for write-back."""
    released = hold_disk_writes(monkeypatch)
    opened: list[tuple[Driver, AdapterWorker]] = []
    block_bytes = gpu_block_bytes(kv_cache_config(1))

    def run(queue_blocks: int | None) -> tuple[Driver, Peak]:
        tier = {"kind": "disk", "path": str(tmp_path), "capacity_bytes": 64 * block_bytes, "writeback": "eager",
                **({"writeback_max_queued_blocks": queue_blocks} if queue_blocks else {})}
        config = vllm_config(model, {"cpu_blocks": 32, "lower_tiers": [tier],
                                     "writeback_max_bytes_in_flight": block_bytes}, 64)
        worker = AdapterWorker(config)
        d = Driver(config, worker)
        opened.append((d, worker))
        planner = d.connector.scheduler_side.kvfsm.tiers
        assert planner is not None
        peak = Peak(lambda: planner.queues()["disk"][0])

        def sample_then_release() -> None:
            peak()
            if not d.scheduler.waiting and not d.scheduler.running:  # every request ran to its end
                released.set()

        for i, prompt in enumerate(PROMPTS):
            d.add(f"r{i}", prompt)
        d.run(MAX_STEPS, after_step=sample_then_release)
        return d, peak

    yield run
    released.set()
    for d, worker in opened:
        d.close()
        d.connector.shutdown()
        worker.close()


def test_a_saturated_tier_sheds_its_write_backs_at_the_queue_bound(held_disk) -> None:
    d, peak = held_disk(BOUND)
    stats = d.connector.scheduler_side.kvfsm.stats
    assert 0 < peak.value <= BOUND
    assert stats.store_shed["disk"] > 0 and "cpu" not in stats.store_shed
    assert shed(scraped(d), "disk") == stats.store_shed["disk"]


def test_control_without_a_queue_bound_a_saturated_tier_queues_every_stored_block(held_disk) -> None:
    _, peak = held_disk(None)
    assert peak.value > BOUND, "the same run without a bound should queue past it: the bound check would see it"


# bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, named", [
    ({"store_max_blocks_in_flight": 0}, "store_max_blocks_in_flight"),
    ({"lower_tiers": [{"kind": "disk", "path": "/tmp/kvfsm-unused", "capacity_bytes": 1 << 20,
                       "writeback_max_queued_blocks": 4}]}, "queue_bound_without_queue"),
])
def test_a_bad_bound_is_refused_at_start_up_by_name(model, extra: dict[str, Any], named: str) -> None:
    """A bound of 0, or a queue bound on an on-evict tier (the default policy), stops vLLM's start-up."""
    config = vllm_config(model, {"cpu_blocks": 8, **extra}, 64)
    with pytest.raises(InvalidExtraConfig, match=named):
        KvfsmConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(64))
