"""Counters an operator expects from an offloader, as a plain object (ready to export to Prometheus)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

RECENT_DURATIONS = 65536
"""Per-job transfer times kept for an exporter's histograms between two scrapes; older ones are dropped."""


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
    blocks_stored: int = 0
    blocks_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    stores_failed: int = 0
    loads_failed: int = 0
    store_seconds: float = 0.0
    """Summed time stores spent in flight, from the step that submitted them to the report of their end."""
    load_seconds: float = 0.0
    """The same for loads: what a request waiting on a CPU hit waited for."""
    recent_seconds: dict[str, deque[float]] = field(
        default_factory=lambda: {"store": deque(maxlen=RECENT_DURATIONS), "load": deque(maxlen=RECENT_DURATIONS)},
        repr=False, compare=False)
    """Each job's time in flight, by direction, until an exporter takes them (`take_seconds`) for a histogram."""

    def record_store(self, cpu_blocks: int, ok: bool, cpu_block_bytes: int, seconds: float) -> None:
        self.store_seconds += seconds
        self.recent_seconds["store"].append(seconds)
        if ok:
            self.blocks_stored += cpu_blocks
            self.bytes_stored += cpu_blocks * cpu_block_bytes
        else:
            self.stores_failed += 1

    def record_load(self, gpu_blocks: int, ok: bool, gpu_block_bytes: int, seconds: float) -> None:
        self.load_seconds += seconds
        self.recent_seconds["load"].append(seconds)
        if ok:
            self.blocks_loaded += gpu_blocks
            self.bytes_loaded += gpu_blocks * gpu_block_bytes
        else:
            self.loads_failed += 1

    def take_seconds(self) -> dict[str, list[float]]:
        """The per-job times recorded since the last call, by direction (one exporter per process takes them)."""
        taken = {direction: list(times) for direction, times in self.recent_seconds.items()}
        for times in self.recent_seconds.values():
            times.clear()
        return taken

    def as_dict(self) -> dict[str, int | float]:
        """The running totals (the counters), without the per-job times."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "recent_seconds"}
