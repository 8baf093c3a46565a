"""The host pool: one pinned allocation cut into equal slots, one CPU block per slot.

A single allocation keeps the registered size equal to the configured size (no allocator rounding) and lets
consecutive slots be moved by one DMA. The buffer is this rank's own (`Device.pin_host`) or a mapping of a region
the ranks of a host share (`SharedHostMemory`, for replicated KV).
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

import torch

from kvfsm.executor.device import Device

if TYPE_CHECKING:
    from kvfsm.executor.shared_host import SharedHostMemory


class PoolClosed(RuntimeError):
    """The pool's memory was released; its slots can no longer be used."""


class HostPool:
    """`num_slots` slots of `slot_bytes` bytes in one host buffer obtained from `device.pin_host`, or from `shared`."""

    def __init__(self, device: Device, num_slots: int, slot_bytes: int,
                 shared: SharedHostMemory | None = None) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"a pool needs positive num_slots and slot_bytes, got {num_slots} x {slot_bytes}")
        self._device = device
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._shared = shared
        nbytes = num_slots * slot_bytes
        self._buffer: torch.Tensor | None = (device.pin_host(nbytes) if shared is None
                                             else shared.allocate(device, nbytes))

    @property
    def buffer(self) -> torch.Tensor:
        """The flat uint8 buffer, exactly `num_slots * slot_bytes` bytes."""
        if self._buffer is None:
            raise PoolClosed("the host pool was closed")
        return self._buffer

    @property
    def registered_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def slot(self, index: int) -> torch.Tensor:
        """The bytes of one slot, as a view into the buffer."""
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index} is outside the pool's {self.num_slots} slots")
        return self.buffer[index * self.slot_bytes:(index + 1) * self.slot_bytes]

    def close(self) -> None:
        """Release the host memory; closing twice is harmless."""
        if self._buffer is not None:
            buffer, self._buffer = self._buffer, None
            if self._shared is None:
                self._device.unpin_host(buffer)
            else:
                self._shared.release(buffer)

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
