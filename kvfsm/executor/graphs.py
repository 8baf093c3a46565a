"""A full chunk's per-plane launches, captured once per staging slot as a CUDA graph and replayed by one host call.

staged-gather gathers a chunk of blocks into a staging slot (and scatters a loaded one out of it) by one kernel per
plane (per layer on kv-first caches): 32 launches of ~9 µs of host time each on an H100 host, ~290 µs a chunk. That
host work stood between a step's start and its first DMA, and paced every later chunk. A graph replay of the same
launches costs ~3 µs of host time and runs the same kernels in the same order; `fused-gather`'s one kernel a chunk
instead took more of a concurrent matmul.

Back to back, though, the launches took more of a concurrent kernel's time than launches paced by a host (and
moved stores faster under it): each slot has a second graph with a short pause between planes (`PACE_NS`),
replayed wherever the copy engine has other chunks to move meanwhile, so compute keeps the precedence it had.

A graph reads fixed addresses, so each slot's graphs read the block ids in a device index of their own. A chunk
copies its ids there first, on the stream the replay then runs on, which is the stream every chunk through that
slot runs on: a later chunk cannot overwrite the ids before the earlier replay has read them.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

Launches = Callable[[torch.Tensor, int, int], None]
"""A chunk's per-plane launches: block ids `index` (on the device), staging slot `slot`, nanoseconds to pause
between two planes' launches."""

PACE_NS = 15_000
"""Nanoseconds a paced replay pauses between two planes' launches. Back to back, the launches took more of a
concurrent matmul: H100, three rounds each, median slowdown 1.027 back to back, 1.020 with pauses of ~8 µs (about
what a host took between launching them), 1.013 with ~15 µs. Much longer pauses bring a chunk's paced gathers near
the length of its DMA, where the pipeline stalls: ~30 µs lost ~30% of the bandwidth every time, ~20 µs in some
rounds. A pause is timed by the GPU's wall clock, not counted in its cycles, so a GPU at lower clocks does not
stretch it toward that stall."""

_WAIT = """template <typename T> T wait_ns(T x, T ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < (unsigned long long)ns);
    return x;
}"""
"""One thread that returns its input once `ns` nanoseconds of the GPU's global timer have passed."""


@functools.cache
def _wait_kernel() -> Callable[..., torch.Tensor]:
    return torch.cuda.jiterator._create_jit_fn(_WAIT, ns=0)


@functools.cache
def _one_element(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, device=device)


def pause(ns: int) -> None:
    """Hold the current stream for `ns` nanoseconds: one tiny kernel, so a graph can hold the pause."""
    _wait_kernel()(_one_element(torch.device("cuda", torch.cuda.current_device())), ns=ns)


def available(device: torch.device) -> bool:
    """Whether launches are captured here: caches on a GPU (the CPU simulator runs each one)."""
    return device.type == "cuda"


class SlotGraphs:
    """For each staging slot, the captured launches of a full chunk through it, back to back and paced, and the
    index they read."""

    def __init__(self, launches: Launches, slots: int, chunk: int, device: torch.device) -> None:
        self._index = [torch.zeros(chunk, dtype=torch.int64, device=device) for _ in range(slots)]
        with torch.cuda.device(device):
            self._graphs = [{paced: self._capture(launches, index, slot, PACE_NS if paced else 0)
                             for paced in (False, True)} for slot, index in enumerate(self._index)]

    @staticmethod
    def _capture(launches: Launches, index: torch.Tensor, slot: int, pause_ns: int) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            launches(index, slot, pause_ns)  # once outside the capture, as torch asks: a first call may set up state
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: an engine's other threads may use CUDA while the caches are being registered
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            launches(index, slot, pause_ns)
        return graph

    def __call__(self, index: torch.Tensor, slot: int, paced: bool) -> None:
        """The launches for blocks `index` (a full chunk's, on the device) through staging slot `slot`, on the
        current stream: `paced` where copies of other chunks run meanwhile, back to back where the copy engine
        waits for them."""
        self._index[slot].copy_(index)
        self._graphs[slot][paced].replay()
