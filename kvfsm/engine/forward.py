"""The reference engine's device work: poisoning freed blocks, and the forward pass, whole or layer by layer.

Every operation goes through the `Device` and declares the blocks (and, layer by layer, the layer) it reads and
writes, so on `SimDevice` the spec's ordering invariants see exactly what a GPU would run. The layer-by-layer
forward calls the connector worker's per-layer hooks around each layer, as vLLM's attention layers do.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvfsm.connector.worker import WorkerConnector
from kvfsm.engine.model import POISON_BYTE, ToyModel
from kvfsm.engine.requests import EngineRequest, Work
from kvfsm.executor.device import Device, Touch


def device_index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """`ids` (block ids, tokens) as an int64 tensor on `device`, copied without blocking the host (pageable
    copies would): the engine's inputs, on its compute stream."""
    if device.type == "cuda":  # made in pinned memory at once: no pageable tensor to copy into pinned first
        return torch.tensor(ids, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(ids, dtype=torch.int64)


class Forward:
    """Enqueues a step's compute on the device's compute stream."""

    def __init__(self, device: Device, model: ToyModel, caches: Sequence[torch.Tensor], layer_names: Sequence[str],
                 block_size: int) -> None:
        self.device = device
        self.model = model
        self.caches = caches
        self.layer_names = layer_names
        self.block_size = block_size

    def poison(self, blocks: list[int], step: int) -> None:
        if not blocks:
            return
        index = device_index(blocks, self.device.tensor_device())

        def fill() -> None:
            for cache in self.caches:
                cache.view(torch.uint8)[:, index] = POISON_BYTE

        self.device.enqueue("compute", "compute", f"poison step {step}", fill,
                            [Touch("write", "gpu", tuple(blocks))])

    def whole(self, work: list[Work], step: int, delay: int) -> None:
        """One compute operation for the whole forward (an engine that never calls the per-layer hooks)."""
        self._whole(work, step, delay, lambda w, total: w.request.sampled.append(self.model.token(total)))

    def partial_sums(self, work: list[Work], step: int, delay: int) -> torch.Tensor | None:
        """The whole forward of a tensor-parallel rank: it writes its heads' KV and fills, per sampled request in
        order, its heads' share of the sum the token is picked from (None when nothing is sampled). `sample` picks
        the tokens once the ranks' shares were summed."""
        sampled = [w for w in work if w.sample]
        if not sampled:
            if work:
                self._whole(work, step, delay, lambda w, total: None)
            return None
        partials = torch.zeros(len(sampled), dtype=torch.float64, device=self.device.tensor_device())
        slot = {id(w): i for i, w in enumerate(sampled)}

        def keep(w: Work, total: torch.Tensor) -> None:
            partials[slot[id(w)]] = total

        self._whole(work, step, delay, keep)
        return partials

    def sample(self, work: list[Work], step: int, summed: Callable[[], torch.Tensor]) -> None:
        """Pick every sampled request's token from `summed()`, the all-reduced shares of every rank, on the compute
        stream (each token is in its request's list from now on, filled in place when the operation runs)."""
        device = self.device.tensor_device()
        slots = []
        for w in work:
            if w.sample:
                slots.append(torch.empty((), dtype=torch.int64, device=device))
                w.request.sampled.append(slots[-1])

        def pick() -> None:
            for slot, token in zip(slots, self.model.token(summed())):
                slot.copy_(token)

        if slots:
            self.device.enqueue("compute", "compute", f"compute step {step} sample", pick)

    def _whole(self, work: list[Work], step: int, delay: int,
               sampled: Callable[[Work, torch.Tensor], None]) -> None:
        device = self.device.tensor_device()

        def forward() -> None:
            if delay:
                torch.cuda._sleep(delay)
            for w in work:
                blocks = device_index(w.blocks, device)
                tokens = self._tokens(w.request, w.start, w.end, device)
                self.model.write(blocks, tokens, w.start)
                if w.sample:
                    sampled(w, self.model.partial_sum(blocks, w.end))

        reads, writes = self._touched(work)
        self.device.enqueue("compute", "compute", f"compute step {step}", forward,
                            [Touch("write", "gpu", writes), Touch("read", "gpu", reads)])

    def _touched(self, work: list[Work]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The blocks a forward reads (every position up to the end) and writes (the new positions)."""
        block_size = self.block_size
        reads = {b for w in work for b in w.blocks[: -(-w.end // block_size)]}
        writes = {b for w in work for b in w.blocks[w.start // block_size: -(-w.end // block_size)]}
        return tuple(sorted(reads)), tuple(sorted(writes))

    def layers(self, work: list[Work], step: int, delay: int, worker: WorkerConnector | None) -> None:
        """One compute operation per layer, each behind `wait_for_layer_load` and followed by `save_kv_layer`."""
        device = self.device.tensor_device()
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per work: blocks, tokens, running sum

        def prepare() -> None:
            if delay:
                torch.cuda._sleep(delay)
            for w in work:
                inputs.append((device_index(w.blocks, device), self._tokens(w.request, w.start, w.end, device),
                               torch.zeros((), dtype=torch.float64, device=device)))

        def layer_op(layer: int) -> None:
            for i, w in enumerate(work):
                blocks, tokens, total = inputs[i]
                self.model.write_layer(layer, blocks, tokens, w.start)
                if w.sample:
                    total += self.model.read_layer(layer, blocks, w.end)

        # Each sample's tensor is in the request's list from now on (the sample writes into it in place), so a
        # rolled-back step drops its sample whether or not the device has run it yet.
        samples = {id(w): torch.empty((), dtype=torch.int64, device=device) for w in work if w.sample}

        def sample() -> None:
            for w, (_, _, total) in zip(work, inputs):
                if w.sample:
                    samples[id(w)].copy_(self.model.token(total))

        reads, writes = self._touched(work)
        self.device.enqueue("compute", "compute", f"compute step {step} inputs", prepare)
        for layer, name in enumerate(self.layer_names):
            if worker is not None:
                worker.wait_for_layer_load(name)
            self.device.enqueue("compute", "compute", f"compute step {step} layer {layer}",
                                lambda layer=layer: layer_op(layer),  # type: ignore[misc]
                                [Touch("write", "gpu", writes, layer), Touch("read", "gpu", reads, layer)])
            if worker is not None:
                worker.save_kv_layer(name)
        self.device.enqueue("compute", "compute", f"compute step {step} sample", sample)
        for w in work:
            if w.sample:
                w.request.sampled.append(samples[id(w)])

    @staticmethod
    def _tokens(request: EngineRequest, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Tokens at positions [start, end): prompt from the host, sampled ones from the device."""
        prompt = device_index(request.prompt[start:end], device)
        sampled = request.sampled[max(0, start - len(request.prompt)): end - len(request.prompt)]
        return torch.cat([prompt, *(t.view(1) for t in sampled)]) if sampled else prompt
