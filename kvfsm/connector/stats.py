"""Counters an operator expects from an offloader, as a plain object (ready to export to Prometheus)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field, fields
from operator import attrgetter

TRANSFER_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""Upper bounds (seconds) of the transfer-time histogram's buckets; one more bucket holds the rest."""


@dataclass
class TransferHistogram:
    """Jobs' times in flight by bucket of `TRANSFER_BUCKETS`: a count and a summed time per bucket, so the memory is
    fixed however long the connector runs, and an exporter can replay an interval exactly (count and sum)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS) + 1))
    sums: list[float] = field(default_factory=lambda: [0.0] * (len(TRANSFER_BUCKETS) + 1))

    def observe(self, seconds: float) -> None:
        bucket = bisect.bisect_left(TRANSFER_BUCKETS, seconds)
        self.counts[bucket] += 1
        self.sums[bucket] += seconds


SKIPPED_BY_REASON = {"prompt-only": "blocks_skipped_prompt_only", "threshold": "blocks_skipped_threshold"}
"""The counter of the blocks admission skipped for each reason (`kvfsm.connector.admission.REASONS`)."""
SHED_PREFIX = "store_shed."
"""`as_dict`'s key of the blocks shed for one tier is this prefix and the tier's name (`store_shed.cpu`)."""


@dataclass
class ConnectorStats:
    lookups: int = 0
    cpu_hit_blocks: int = 0
    """GPU blocks offered for reload from CPU by lookups."""
    cpu_misses: int = 0
    """Lookups that found nothing on CPU beyond the GPU prefix."""
    deferrals: int = 0
    store_refusals: int = 0
    """Stores not ordered because no CPU slot could be freed (the request simply is not offloaded)."""
    blocks_skipped_prompt_only: int = 0
    """CPU blocks admission skipped because they lie past their request's prompt (`admission="prompt-only"`)."""
    blocks_skipped_threshold: int = 0
    """CPU blocks admission skipped because they were offered fewer than `store_threshold` times."""
    blocks_stored: int = 0
    blocks_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    stores_failed: int = 0
    loads_failed: int = 0
    loads_inline: int = 0
    """Load jobs the engine computes on in the step that loads them (`OffloadConfig.inline_loads`)."""
    loads_async: int = 0
    """Load jobs the engine computes on only once they are reported: every load without `layer_loads`, and every
    load under an engine that schedules ahead (`async_scheduling`), which shows here that `layer_loads` fell back."""
    store_seconds: float = 0.0
    """Summed time stores spent in flight, from the step that submitted them to the report of their end."""
    load_seconds: float = 0.0
    """The same for loads: what a request waiting on a CPU hit waited for."""
    store_shed: Counter[str] = field(default_factory=Counter, compare=False)
    """Blocks back-pressure shed, by tier: `cpu` for GPU-to-CPU stores beyond `store_max_blocks_in_flight`
    (`stores-bounded`), a lower tier's name for write-backs beyond its `writeback_max_queued_blocks`
    (`writeback-queue-bounded`)."""
    transfer_times: dict[str, TransferHistogram] = field(
        default_factory=lambda: {"store": TransferHistogram(), "load": TransferHistogram()}, repr=False,
        compare=False)
    """Each job's time in flight, by direction, as a histogram."""

    def record_skipped(self, reason: str, cpu_blocks: int) -> None:
        """`cpu_blocks` skipped by admission for `reason` (a key of `SKIPPED_BY_REASON`)."""
        name = SKIPPED_BY_REASON[reason]
        setattr(self, name, getattr(self, name) + cpu_blocks)

    def record_shed(self, tier: str, blocks: int) -> None:
        self.store_shed[tier] += blocks

    def record_store(self, cpu_blocks: int, ok: bool, cpu_block_bytes: int, seconds: float) -> None:
        self.store_seconds += seconds
        self.transfer_times["store"].observe(seconds)
        if ok:
            self.blocks_stored += cpu_blocks
            self.bytes_stored += cpu_blocks * cpu_block_bytes
        else:
            self.stores_failed += 1

    def record_load_started(self, inline: bool) -> None:
        if inline:
            self.loads_inline += 1
        else:
            self.loads_async += 1

    def record_load(self, gpu_blocks: int, ok: bool, gpu_block_bytes: int, seconds: float) -> None:
        self.load_seconds += seconds
        self.transfer_times["load"].observe(seconds)
        if ok:
            self.blocks_loaded += gpu_blocks
            self.bytes_loaded += gpu_blocks * gpu_block_bytes
        else:
            self.loads_failed += 1

    def as_dict(self) -> dict[str, int | float]:
        """The running totals (the counters), without the histograms; the blocks shed per tier under
        `SHED_PREFIX` + the tier's name, one key each."""
        totals = dict(zip(TOTALS, _read_totals(self)))
        return totals | {SHED_PREFIX + tier: count for tier, count in self.store_shed.items()}


TOTALS = tuple(f.name for f in fields(ConnectorStats) if f.name not in ("transfer_times", "store_shed"))
"""The counters `as_dict` lists, named once: vLLM asks for the totals every step, and walking the dataclass's fields
each time was most of what asking cost."""
_read_totals = attrgetter(*TOTALS)
