"""Host memory the Mooncake client moves bytes through: where a view lives, and which ranges are registered.

Mooncake reads and writes host memory in place only once that memory is registered with it, and registering is
costly, so a whole buffer is registered once and every view into it rides on that registration. This module keeps
the address arithmetic (`address`, `Registrations`) and `SlotRegion`, a host buffer cut into slots with one value
trailer each, which tests and the benchmark use as their source and target memory.
"""

from __future__ import annotations

import bisect
import ctypes
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from kvfsm.mooncake import value


class SlotRegion:
    """A host buffer cut into slots, with one value trailer per slot (tests and the benchmark use it)."""

    def __init__(self, buffer: torch.Tensor, slot_bytes: int) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.device.type != "cpu":
            raise ValueError("a slot region is a flat uint8 host tensor")
        if slot_bytes <= 0 or buffer.numel() % slot_bytes:
            raise ValueError(f"{buffer.numel()} bytes do not cut into slots of {slot_bytes}")
        self.buffer = buffer
        self.slot_bytes = slot_bytes
        self.num_slots = buffer.numel() // slot_bytes
        self.trailers = torch.zeros(self.num_slots * value.TRAILER_BYTES, dtype=torch.uint8)

    def payload(self, slot: int) -> np.ndarray:
        return self.buffer.numpy()[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def trailer(self, slot: int) -> np.ndarray:
        return self.trailers.numpy()[slot * value.TRAILER_BYTES:(slot + 1) * value.TRAILER_BYTES]

    def payloads(self, slots: Sequence[int]) -> list[np.ndarray]:
        return [self.payload(slot) for slot in slots]

    def trailers_of(self, slots: Sequence[int]) -> list[np.ndarray]:
        return [self.trailer(slot) for slot in slots]


def address(array: np.ndarray) -> int:
    """Where `array`'s first byte lives. A call takes the address of every view it moves (256 for a 128-block
    fetch), so the cheap way comes first: a ctypes view of a writable buffer, a quarter of the time of numpy's
    `ctypes.data`, which read-only, empty or strided arrays still take (ctypes refuses their buffers)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):
        return int(array.ctypes.data)


class Buffers(NamedTuple):
    """Host buffers as a store call takes them: their addresses and their lengths."""

    at: list[int]
    sizes: list[int]

    def pick(self, indices: Sequence[int]) -> Buffers:
        return Buffers([self.at[i] for i in indices], [self.sizes[i] for i in indices])


class Registrations:
    """Host ranges registered with Mooncake; a view inside one needs no registration of its own."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}

    def covers(self, start: int, size: int) -> bool:
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and start + size <= self._ends[self._starts[i]]

    def locate(self, arrays: Sequence[np.ndarray], register: Callable[[int, int], None]) -> Buffers:
        """Where `arrays` are, each first registered whole by `register(start, size)` unless it lies inside a range
        registered already (a call takes its buffers' addresses once, for this check and its store calls both)."""
        located = Buffers([], [])
        for array in arrays:
            start, size = address(array), array.nbytes
            if not self.covers(start, size):
                register(start, size)
                self.add(start, size)
            located.at.append(start)
            located.sizes.append(size)
        return located

    def add(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._ends[start] = start + size

    def starts(self) -> list[int]:
        return list(self._starts)
