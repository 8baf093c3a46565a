"""The `Device` protocol on a real GPU: torch streams and events, and a pinned host pool that is exactly its size.

The compute stream is whatever stream the engine computes on (torch's current stream when the device is built);
the store and load streams are private, so offload traffic is ordered against compute only through the waits the
connector asks for. Host memory is one plain allocation registered with `cudaHostRegister` rather than torch's
pinned caching allocator, which rounds each request up to a power of two (a 40 GiB pool would pin 64 GiB).

Several devices in one process (tensor-parallel ranks on threads, `python -m kvfsm.bench mla`): a registration is
the process's, made with the device's context current and `cudaHostRegisterPortable`, so every device's copies see
the memory as pinned (a plain registration is pinned for the registering context alone; other devices would copy
it as pageable memory, staged and synchronous). A second registration of a range still registered is refused by
CUDA (`HostMemoryAlreadyRegistered`): memory the ranks of a process share is registered once
(`kvfsm.executor.shared_host`).
"""

from __future__ import annotations

import mmap
from typing import Callable, Iterable

import torch

from kvfsm.executor.device import HostMemoryAlreadyRegistered, StreamName, Touch
from kvfsm.executor.access import Access, Actor

HOST_REGISTER_PORTABLE = 1
"""`cudaHostRegisterPortable`: the registration holds for every CUDA context of the process."""
ALREADY_REGISTERED = 712
"""`cudaErrorHostMemoryAlreadyRegistered`."""


class HostRegisterError(RuntimeError):
    """The CUDA runtime refused to register (or unregister) a host buffer."""


class CudaUnavailable(RuntimeError):
    """`CudaDevice` was built where torch sees no CUDA device (or not the one named)."""


class CudaDevice:
    """Three CUDA streams and torch events; `enqueue` issues work at once, on the named stream."""

    kind = "cuda"
    accesses: tuple[Access, ...] = ()  # the GPU keeps no access log; the ordering invariants run on SimDevice

    def __init__(self, index: int | None = None) -> None:
        """Checks first that the device exists: torch would otherwise fail on its first CUDA call with a bare
        `AssertionError` (a CPU-only build) or an invalid-ordinal error that does not say which index was asked."""
        if not torch.cuda.is_available():
            raise CudaUnavailable("CudaDevice: torch sees no CUDA device here; on a CPU-only machine use "
                                  "kvfsm.executor.SimDevice")
        count = torch.cuda.device_count()
        if index is not None and not 0 <= index < count:
            raise CudaUnavailable(f"CudaDevice: no CUDA device {index}; legal: 0 to {count - 1}")
        self._device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.streams: dict[StreamName, torch.cuda.Stream] = {
            "compute": torch.cuda.current_stream(self._device),
            "store": torch.cuda.Stream(self._device),
            "load": torch.cuda.Stream(self._device),
        }
        self._registered: dict[int, int] = {}
        self._mappings: dict[int, mmap.mmap] = {}
        self._shared: dict[int, int] = {}
        """Mappings of shared regions registered by `register_host`, bytes by data pointer."""

    def tensor_device(self) -> torch.device:
        return self._device

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, stream: StreamName, event: torch.cuda.Event) -> None:
        event.record(self.streams[stream])

    def wait(self, stream: StreamName, event: torch.cuda.Event) -> None:
        self.streams[stream].wait_event(event)

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def enqueue(self, stream: StreamName, actor: Actor, label: str, fn: Callable[[], None],
                touches: Iterable[Touch] = ()) -> None:
        with torch.cuda.stream(self.streams[stream]):
            fn()

    def pin_host(self, nbytes: int) -> torch.Tensor:
        """Register exactly `nbytes` of an anonymous mapping: page-aligned and sharing no page with any other
        buffer (the driver pins whole pages, so a buffer sharing a page with a pinned one would be refused)."""
        if nbytes <= 0:
            raise ValueError(f"a host allocation needs a positive size, got {nbytes}")
        mapping = mmap.mmap(-1, nbytes)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        self._host_register(buffer)
        self._registered[buffer.data_ptr()] = nbytes
        self._mappings[buffer.data_ptr()] = mapping
        return buffer

    def unpin_host(self, buffer: torch.Tensor) -> None:
        if self._registered.pop(buffer.data_ptr(), None) is None:
            raise HostRegisterError("this buffer was not registered by pin_host, or was already released")
        self._mappings.pop(buffer.data_ptr())  # the mapping is unmapped once the last tensor on it is gone
        _host_unregister(buffer)

    def register_host(self, buffer: torch.Tensor) -> None:
        """Page-lock a mapping of a region the ranks share, for every device of this process (registered once)."""
        self._host_register(buffer)
        self._shared[buffer.data_ptr()] = buffer.numel()

    def unregister_host(self, buffer: torch.Tensor) -> None:
        if self._shared.pop(buffer.data_ptr(), None) is None:
            raise HostRegisterError("this buffer was not registered by register_host, or was already unregistered")
        _host_unregister(buffer)

    def _host_register(self, buffer: torch.Tensor) -> None:
        """Register with this device's context current (the caller's thread may be on another device), portable."""
        with torch.cuda.device(self._device):
            code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), HOST_REGISTER_PORTABLE))
        if code == ALREADY_REGISTERED:
            raise HostMemoryAlreadyRegistered(f"cudaHostRegister of {buffer.numel()} bytes: the range is registered "
                                              "in this process already (by this device or another)")
        if code != 0:
            raise HostRegisterError(f"cudaHostRegister of {buffer.numel()} bytes failed with cudaError {code}")

    @property
    def host_bytes(self) -> int:
        """Bytes currently registered through `pin_host`: what a leak check looks at."""
        return sum(self._registered.values())


def _host_unregister(buffer: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    if code != 0:
        raise HostRegisterError(f"cudaHostUnregister failed with cudaError {code}")
