"""Two-slot pipelines: how a staged transfer overlaps its GPU-side work with its DMA.

A staged transfer is a list of steps; each step produces into staging slot `i % 2` and then consumes from it. On
the GPU the producer runs on a private side stream and the consumer on the stream the transfer was enqueued on, so
step i+1's production overlaps step i's consumption; events keep a slot from being refilled before its previous
consumer finished. From outside, the whole transfer still behaves as one operation of the enqueuing stream: the
side stream starts behind everything already on that stream, and that stream ends behind the side stream. Off the
GPU the same steps run inline, in order.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

Step = tuple[Callable[[int], None], Callable[[int], None]]  # (produce into slot, consume from slot)
SLOTS = 2


class Lanes(Protocol):
    def run(self, steps: Sequence[Step], join: bool = True) -> None:
        """Run every step's produce then consume, in step order, taking turns over the `SLOTS` slots. `join=False`
        continues the previous run on the same stream without waiting for that stream again first (the next
        layer of a job whose first layer already waited)."""


class InlineLanes:
    """Steps run one after another on the calling thread (the simulator's view of a transfer)."""

    def run(self, steps: Sequence[Step], join: bool = True) -> None:
        for i, (produce, consume) in enumerate(steps):
            produce(i % SLOTS)
            consume(i % SLOTS)


class CudaLanes:
    """Producers on a side stream, consumers on the current stream, handing slots over through events that
    persist from run to run, so consecutive runs (a job's layers) keep the pipeline full."""

    def __init__(self, device: torch.device) -> None:
        self._side = torch.cuda.Stream(device)
        self._filled = [torch.cuda.Event() for _ in range(SLOTS)]
        self._freed = [torch.cuda.Event() for _ in range(SLOTS)]
        self._turn = 0

    def run(self, steps: Sequence[Step], join: bool = True) -> None:
        main = torch.cuda.current_stream()
        if join:
            self._side.wait_stream(main)
        for produce, consume in steps:
            slot = self._turn % SLOTS
            self._turn += 1
            with torch.cuda.stream(self._side):
                self._side.wait_event(self._freed[slot])  # no-op until the slot's first consumer recorded it
                produce(slot)
                self._filled[slot].record(self._side)
            main.wait_event(self._filled[slot])
            consume(slot)
            self._freed[slot].record(main)
        main.wait_stream(self._side)


def lanes_for(device: torch.device) -> Lanes:
    """Side-stream pipelining where the caches are on a GPU, inline steps elsewhere."""
    return CudaLanes(device) if device.type == "cuda" else InlineLanes()
