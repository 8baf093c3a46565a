"""What a reference engine is built from (`EngineConfig`) and the named errors it refuses bad calls with.

Apart from `engine.py` so that what builds an engine (the Harness, the demo's plan, the oracle) and what catches its
refusals depends on these plain definitions, not on the scheduling loop itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfsm.engine.model import ModelShape


class RequestIdInUse(ValueError):
    """A request id was reused while the earlier request with that id is still in the engine."""


class LayerByLayerOnOneDevice(ValueError):
    """A tensor-parallel engine was asked to compute layer by layer (only one device does)."""


@dataclass(frozen=True)
class EngineConfig:
    num_gpu_blocks: int = 16
    max_batched_tokens: int = 64
    model: ModelShape = ModelShape()
    compute_delay_cycles: int = 0
    """CUDA only: the compute stream sleeps this long before each forward (`torch.cuda._sleep`)."""
    per_layer: bool = False
    """Compute layer by layer, calling the per-layer hooks, and compute a CPU hit in the step that loads it."""
    report_lag: int = 0
    """Steps a worker's transfer report waits before the connector hears of it. 1 is vLLM's async scheduling: step
    N's output is processed after step N+1 was scheduled, so a preempted request can look up again while its
    flushed stores are still unreported."""
