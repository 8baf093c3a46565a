"""The metrics kvfsm exports, declared once: each counter names the `ConnectorStats` field it reads.

A connector with lower tiers exports more (`counters`): each tier's hits under `kvfsm_hit_blocks`, and its own
families, labelled by tier name. Two exporters read this catalogue: `kvfsm.connector.prometheus.KvfsmCollector`
(prometheus_client, any engine) and the vLLM adapter's `KvfsmPromMetrics` (vLLM's own Prometheus registry, fed by
its connector-stats hook), so both expose the same names, labels and buckets. Nothing here imports
prometheus_client.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from kvfsm.config import CPU_TIER
from kvfsm.connector.stats import SHED_PREFIX, TRANSFER_BUCKETS
from kvfsm.tiers.base import TierFailure

DIRECTIONS = ("store", "load")
"""store: GPU to CPU; load: CPU to GPU."""


@dataclass(frozen=True)
class CounterFamily:
    """One Prometheus counter; each sample reads one `ConnectorStats` field under fixed label values."""

    name: str
    documentation: str
    samples: tuple[tuple[dict[str, str], str], ...]
    """(label values, ConnectorStats field) per sample."""

    @property
    def labelnames(self) -> list[str]:
        return sorted(self.samples[0][0]) if self.samples else []


@dataclass(frozen=True)
class TierCounterFamily:
    """One Prometheus counter labelled `tier`, one sample per tier that has a count: the `ConnectorStats.as_dict` keys
    under `prefix`, whose rest is the tier's name (lower tiers are named by the user, so the samples are not fixed)."""

    name: str
    documentation: str
    prefix: str

    def tier(self, key: str) -> str | None:
        """The tier a totals key counts for, or None for a key of another metric."""
        return key[len(self.prefix):] if key.startswith(self.prefix) else None


@dataclass(frozen=True)
class HistogramFamily:
    name: str
    documentation: str
    buckets: tuple[float, ...] = TRANSFER_BUCKETS


@dataclass(frozen=True)
class GaugeFamily:
    name: str
    documentation: str


COUNTERS: tuple[CounterFamily, ...] = (
    CounterFamily("kvfsm_lookups", "Prefix lookups answered by the connector (deferred ones included).",
                  (({}, "lookups"),)),
    CounterFamily("kvfsm_hit_blocks", "GPU blocks a lookup offered to reload, by the tier that holds them.",
                  (({"tier": CPU_TIER}, "cpu_hit_blocks"),)),
    CounterFamily("kvfsm_lookup_misses", "Lookups that found nothing beyond the GPU prefix, by tier.",
                  (({"tier": CPU_TIER}, "cpu_misses"),)),
    CounterFamily("kvfsm_deferrals", "Lookups deferred because blocks they need were being moved by another job.",
                  (({}, "deferrals"),)),
    CounterFamily("kvfsm_store_refusals", "Stores not ordered because no CPU block could be freed for them.",
                  (({}, "store_refusals"),)),
    CounterFamily("kvfsm_store_skipped", "CPU blocks admission did not store, by reason: prompt-only (past the "
                  "request's prompt) or threshold (offered fewer than store_threshold times).",
                  (({"reason": "prompt-only"}, "blocks_skipped_prompt_only"),
                   ({"reason": "threshold"}, "blocks_skipped_threshold"))),
    CounterFamily("kvfsm_blocks", "Blocks moved by jobs that completed, by direction (CPU blocks for stores, "
                  "GPU blocks for loads).", (({"direction": "store"}, "blocks_stored"),
                                             ({"direction": "load"}, "blocks_loaded"))),
    CounterFamily("kvfsm_bytes", "Bytes moved by jobs that completed, by direction.",
                  (({"direction": "store"}, "bytes_stored"), ({"direction": "load"}, "bytes_loaded"))),
    CounterFamily("kvfsm_loads", "Load jobs started, by when the engine computes on them: inline (in the step that "
                  "loads them, layer_loads) or async (once reported; also layer_loads under async scheduling).",
                  (({"mode": "inline"}, "loads_inline"), ({"mode": "async"}, "loads_async"))),
    CounterFamily("kvfsm_failed_jobs", "Transfer jobs that failed (a failed load is recomputed), by direction.",
                  (({"direction": "store"}, "stores_failed"), ({"direction": "load"}, "loads_failed"))),
)
TIER_DIRECTIONS = ("write-back", "fetch")
"""write-back: CPU pool to a lower tier; fetch: a lower tier to the CPU pool."""


def tier_key(counter: str, label: str) -> str:
    """The name a lower tier's running total travels under beside the `ConnectorStats` fields: `counter` of the
    tier (or failure reason) `label`. `kvfsm.connector.tier_planner.TierPlanner.totals` writes these."""
    return f"tier.{counter}.{label}"


def counters(lower_tiers: Sequence[str] = ()) -> tuple[CounterFamily, ...]:
    """Every counter of a connector whose lower tiers are named `lower_tiers` (in lookup order): `COUNTERS`, with
    each lower tier's hits beside the CPU pool's, then the blocks and bytes each tier moved by direction, the tokens
    it served, and the keys that did not move by reason. A block found below the CPU pool is counted under its tier
    when its fetch is ordered, and under `cpu` again when the CPU pool it was fetched into serves it."""
    if not lower_tiers:
        return COUNTERS
    hits = [({"tier": tier}, tier_key("hit_blocks", tier)) for tier in lower_tiers]
    extended = tuple(replace(c, samples=c.samples + tuple(hits)) if c.name == "kvfsm_hit_blocks" else c
                     for c in COUNTERS)
    by_direction = [(tier, d) for tier in lower_tiers for d in TIER_DIRECTIONS]
    return extended + (
        CounterFamily("kvfsm_tier_blocks", "CPU blocks moved between the CPU pool and a lower tier by jobs that "
                      "ended, by tier and direction.",
                      tuple(({"direction": d, "tier": t}, tier_key(f"blocks.{d}", t)) for t, d in by_direction)),
        CounterFamily("kvfsm_tier_bytes", "Bytes moved between the CPU pool and a lower tier by jobs that ended, by "
                      "tier and direction.",
                      tuple(({"direction": d, "tier": t}, tier_key(f"bytes.{d}", t)) for t, d in by_direction)),
        CounterFamily("kvfsm_tier_loaded_tokens", "Tokens loaded into the GPU from CPU blocks a fetch brought from "
                      "a lower tier, by tier.",
                      tuple(({"tier": t}, tier_key("loaded_tokens", t)) for t in lower_tiers)),
        CounterFamily("kvfsm_tier_failures", "Keys a write-back or fetch did not move (a miss, never wrong bytes), "
                      "by reason.",
                      tuple(({"reason": r.value}, tier_key("failures", r.value)) for r in TierFailure)),
    )


STORE_SHED = TierCounterFamily(
    "kvfsm_store_shed", "Blocks back-pressure shed instead of queueing them, by tier: cpu (GPU-to-CPU stores beyond "
    "store_max_blocks_in_flight) or a lower tier's name (write-backs beyond its writeback_max_queued_blocks).",
    SHED_PREFIX)
TRANSFER_SECONDS = HistogramFamily(
    "kvfsm_transfer_seconds", "Each job's time in flight, from the step that submitted it to the report of its end, "
    "by direction.")
POOL_BLOCKS = GaugeFamily("kvfsm_pool_blocks", "CPU blocks of the host pool in each state of the cpu-block "
                          "lifecycle.")
