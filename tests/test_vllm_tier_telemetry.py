"""What an operator and vLLM's KV-event consumers see of the lower tiers under vLLM's real Scheduler.

Metrics: each lower tier's hits (`kvfsm_hit_blocks_total{tier=...}` beside the CPU pool's), the blocks and bytes it
moved by direction, the tokens it served and the keys that did not move by reason, through vLLM's stats hook into
its own Prometheus metrics, equal to the planner's totals and to what kvfsm's own collector exports.
Events: every key entering or leaving a tier's index is announced with `MEDIUM_STORAGE`, the tier's locality and its
name, so a consumer replaying them knows what each tier can serve, apart from the CPU pool (`MEDIUM_CPU`).
Skipped when vLLM is not installed.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry  # noqa: E402
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from kvfsm.connector.prometheus import KvfsmCollector  # noqa: E402
from kvfsm.integrations.vllm.tier_events import AnnouncedEntries, to_vllm  # noqa: E402
from kvfsm.manager.events import BlockStored as KvfsmBlockStored  # noqa: E402
from kvfsm.states import TierEntryState  # noqa: E402
from kvfsm.tiers.entries import TierEntries  # noqa: E402
from test_vllm_metrics import sample  # noqa: E402
from test_vllm_tier_faults import tier_stats  # noqa: E402
from test_vllm_tiers import (  # noqa: E402
    BLOCK_BYTES,
    BLOCK_SIZE,
    MAX_STEPS,
    OTHERS,
    PREFIX,
    corrupt_slot_file,
    disk_tier,
    evict_from_cpu_then_reload,
    tiered,
)
from vllm_harness import Driver  # noqa: E402
from vllm_support import model, scraped  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm

BLOCKS = len(PREFIX) // BLOCK_SIZE


def tier_samples(registry: CollectorRegistry, labels: dict[str, str]) -> dict[tuple[str, str, str], float | None]:
    """The disk tier's samples, keyed by (metric, label, value); `labels` are the registry's own (vLLM's engine)."""
    wanted = [("kvfsm_hit_blocks_total", "tier", "disk"), ("kvfsm_hit_blocks_total", "tier", "cpu"),
              ("kvfsm_tier_loaded_tokens_total", "tier", "disk")]
    wanted += [(name, "direction", d) for name in ("kvfsm_tier_blocks_total", "kvfsm_tier_bytes_total")
               for d in ("write-back", "fetch")]
    wanted += [("kvfsm_tier_failures_total", "reason", r) for r in ("corrupt", "full")]
    return {(name, label, value): registry.get_sample_value(name, {**labels, label: value,
                                                                   **({"tier": "disk"} if label == "direction"
                                                                      else {})})
            for name, label, value in wanted}


def test_vllm_metrics_count_each_tiers_hits_blocks_bytes_and_tokens(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    evict_from_cpu_then_reload(d, [worker])
    registry, stats = scraped(d), tier_stats(d)
    assert sample(registry, "kvfsm_hit_blocks_total", tier="disk") == BLOCKS
    assert sample(registry, "kvfsm_tier_blocks_total", tier="disk", direction="fetch") == BLOCKS
    assert sample(registry, "kvfsm_tier_bytes_total", tier="disk", direction="fetch") == BLOCKS * BLOCK_BYTES
    written = sample(registry, "kvfsm_tier_blocks_total", tier="disk", direction="write-back")
    assert written == stats.blocks_written_back["disk"] >= BLOCKS
    assert sample(registry, "kvfsm_tier_bytes_total", tier="disk", direction="write-back") == written * BLOCK_BYTES
    assert sample(registry, "kvfsm_tier_loaded_tokens_total", tier="disk") == len(PREFIX)
    cpu_hits = d.connector.scheduler_side.kvfsm.stats.cpu_hit_blocks
    assert sample(registry, "kvfsm_hit_blocks_total", tier="cpu") == cpu_hits


def test_vllm_metrics_count_a_tiers_failures_by_reason(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    evict_from_cpu_then_reload(d, [worker], lambda: corrupt_slot_file(worker))
    corrupt = sample(scraped(d), "kvfsm_tier_failures_total", reason="corrupt")
    assert corrupt == tier_stats(d).failures["corrupt"] > 0


def test_kvfsms_own_collector_exports_the_tier_counters_vllm_shows(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    evict_from_cpu_then_reload(d, [worker], lambda: corrupt_slot_file(worker))
    own = CollectorRegistry()
    own.register(KvfsmCollector.of(d.connector.scheduler_side.kvfsm))
    shown = tier_samples(scraped(d), {"model_name": "tiny", "engine": "0"})
    assert shown == tier_samples(own, {})
    assert all(value is not None for value in shown.values())


def test_control_a_stats_hook_without_the_tier_totals_shows_no_tier_traffic(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path))
    d.connector.scheduler_side.stats._tier_totals = dict  # the CPU pool's counters only, as before the tiers
    evict_from_cpu_then_reload(d, [worker])
    assert sample(scraped(d), "kvfsm_hit_blocks_total", tier="disk") == 0
    assert tier_stats(d).blocks_fetched["disk"] == BLOCKS


# --- KV-cache events -------------------------------------------------------------------------------------------


class Recorded:
    """vLLM's event publisher, replaced by one that keeps every batch the scheduler published."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def replay(events: Iterable[Any]) -> dict[tuple[str | None, str | None, str | None], set[bytes]]:
    """What a consumer holds after replaying the stored and removed events in order: the hashes held, by (medium,
    locality, owner)."""
    held: dict[tuple[str | None, str | None, str | None], set[bytes]] = defaultdict(set)
    for event in events:
        if not isinstance(event, (BlockStored, BlockRemoved)):  # vLLM's GPU cache cleared: not a medium here
            continue
        where = held[(event.medium, getattr(event, "locality", None), getattr(event, "ownership", None))]
        if isinstance(event, BlockStored):
            where.update(event.block_hashes)
        else:
            where.difference_update(event.block_hashes)
    return held


def servable(d: Driver) -> set[bytes]:
    """The keys the scheduler's disk index can serve now (published or being read), as vLLM names them."""
    (index,) = d.connector.scheduler_side.tier_index.tiers
    return {d.connector.scheduler_side.codec.to_bytes(entry.key) for entry in index.entries
            if entry.state in (TierEntryState.PUBLISHED, TierEntryState.READING)}


def replayed_after_every_step(d: Driver, published: Recorded) -> list[str]:
    """Steps the driver from now on, comparing after each the replayed disk events with the index."""
    mismatches: list[str] = []
    step = d.step

    def checked() -> Any:
        log = step()
        shown = replay(published.events)[(MEDIUM_STORAGE, "LOCAL", "disk")]
        if shown != servable(d):
            mismatches.append(f"step {d.step_no}: events show {len(shown)} keys, the index serves "
                              f"{len(servable(d))}")
        return log

    d.step = checked  # type: ignore[method-assign]
    return mismatches


def disk_events_run(tiered, path: Path) -> tuple[Driver, Recorded, list[str]]:
    """A disk of 4 blocks under a CPU pool of 8: the prefix is written back, pushed out of the disk by the others'
    write-backs (removed), then its reader recomputes it (written back again); every step replayed."""
    d, _ = tiered(disk_tier(path, blocks=4), kv_events=True)
    published = Recorded()
    d.scheduler.kv_event_publisher = published
    mismatches = replayed_after_every_step(d, published)
    d.add("writer", PREFIX + [1, 2, 3])
    d.run(MAX_STEPS)
    for i, other in enumerate(OTHERS):
        d.add(f"other{i}", other + [1])
        d.run(MAX_STEPS)
    d.add("reader", PREFIX + [9])
    d.run(MAX_STEPS)
    return d, published, mismatches


def test_blocks_entering_and_leaving_the_disk_tier_are_announced_with_its_medium(tiered, tmp_path: Path) -> None:
    d, published, mismatches = disk_events_run(tiered, tmp_path)
    assert mismatches == []
    storage = [e for e in published.events if getattr(e, "medium", None) == MEDIUM_STORAGE]
    assert {(e.locality, e.ownership) for e in storage} == {("LOCAL", "disk")}
    assert any(not isinstance(e, BlockStored) for e in storage), "no key left the disk tier"
    assert replay(published.events)[(MEDIUM_CPU, None, None)], "the CPU pool's events are there too"
    assert servable(d)


def test_control_an_index_that_does_not_announce_evictions_is_caught(
        tiered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AnnouncedEntries, "evict", TierEntries.evict)
    _, _, mismatches = disk_events_run(tiered, tmp_path)
    assert mismatches


def test_a_key_whose_fetch_failed_is_announced_as_leaving_the_disk_tier(tiered, tmp_path: Path) -> None:
    d, (worker,) = tiered(disk_tier(tmp_path), kv_events=True)
    published = Recorded()
    d.scheduler.kv_event_publisher = published
    mismatches = replayed_after_every_step(d, published)
    evict_from_cpu_then_reload(d, [worker], lambda: corrupt_slot_file(worker))
    assert tier_stats(d).failures["corrupt"] > 0
    assert mismatches == []


def test_a_lower_tiers_stored_event_names_its_blocks_and_where_they_are_and_nothing_else() -> None:
    event = to_vllm(KvfsmBlockStored((7,)), lambda key: key.to_bytes(2, "big"), MEDIUM_STORAGE, "LOCAL", "disk")
    assert event == BlockStored(block_hashes=[b"\x00\x07"], parent_block_hash=None, token_ids=[], block_size=0,
                                lora_id=None, medium=MEDIUM_STORAGE, lora_name=None, locality="LOCAL",
                                ownership="disk")


def test_without_kv_events_the_index_records_no_announcements(tiered, tmp_path: Path) -> None:
    """Nothing takes them then: recorded, they would only grow."""
    d, _ = tiered(disk_tier(tmp_path))
    (index,) = d.connector.scheduler_side.tier_index.tiers
    assert type(index.entries) is TierEntries

