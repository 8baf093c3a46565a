"""Counters an operator expects from an offloader, as a plain object (ready to export to Prometheus)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def record_store(self, cpu_blocks: int, ok: bool, cpu_block_bytes: int, seconds: float) -> None:
        self.store_seconds += seconds
        if ok:
            self.blocks_stored += cpu_blocks
            self.bytes_stored += cpu_blocks * cpu_block_bytes
        else:
            self.stores_failed += 1

    def record_load(self, gpu_blocks: int, ok: bool, gpu_block_bytes: int, seconds: float) -> None:
        self.load_seconds += seconds
        if ok:
            self.blocks_loaded += gpu_blocks
            self.bytes_loaded += gpu_blocks * gpu_block_bytes
        else:
            self.loads_failed += 1

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)
