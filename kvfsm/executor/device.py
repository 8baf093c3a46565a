"""The device interface: three streams, events, and operations enqueued on a stream.

kvfsm's ordering rules are expressed only through this interface, so they mean the same on `CudaDevice` (real
streams and copy engines) and on `SimDevice` (a deterministic virtual GPU whose schedule the caller picks). An
operation is a callable that does real work on tensors; on CUDA it runs at once, enqueuing kernels and copies on
the stream; on the simulator it runs when the schedule picks its stream. Each operation declares the blocks it
reads and writes, which the simulator logs so the spec's ordering invariants can be checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Protocol

from kvfsm.executor.access import Actor, Mode, Space

StreamName = Literal["compute", "store", "load"]
STREAMS: tuple[StreamName, ...] = ("compute", "store", "load")


@dataclass(frozen=True, slots=True)
class Touch:
    """Blocks an operation reads or writes: the unit the spec's ordering invariants speak of. `layer` narrows a
    GPU touch to one layer segment (one registered tensor) of those blocks; None means every layer."""

    mode: Mode
    space: Space
    blocks: tuple[int, ...]
    layer: int | None = None


class HostMemoryAlreadyRegistered(ValueError):
    """Host memory registered while a registration of it is still live, by this device or another of the process.
    Page-locking belongs to the process, not to a device: CUDA refuses a second `cudaHostRegister` of a range
    (cudaErrorHostMemoryAlreadyRegistered), so memory every rank of a process uses is registered once, portable."""


class Event(Protocol):
    """A marker recorded on a stream; done once everything enqueued before it on that stream ran."""


class Device(Protocol):
    kind: str

    def tensor_device(self) -> Any:
        """The torch device KV caches live on (`cuda` or `cpu`)."""

    def new_event(self) -> Event: ...

    def record(self, stream: StreamName, event: Event) -> None:
        """Mark `event` at the current tail of `stream`."""

    def wait(self, stream: StreamName, event: Event) -> None:
        """Later work on `stream` runs only after `event` is done (no-op if it was never recorded)."""

    def query(self, event: Event) -> bool:
        """Whether `event` is done, without blocking."""

    def synchronize(self, event: Event) -> None:
        """Block the host until `event` is done."""

    def enqueue(self, stream: StreamName, actor: Actor, label: str, fn: Callable[[], None],
                touches: Iterable[Touch] = ()) -> None:
        """Run `fn` in order on `stream`; `touches` says which blocks it reads and writes."""

    def pin_host(self, nbytes: int) -> Any:
        """One host allocation of exactly `nbytes` bytes (pinned on CUDA), as a flat uint8 tensor."""

    def unpin_host(self, buffer: Any) -> None:
        """Release what `pin_host` allocated."""

    def register_host(self, buffer: Any) -> None:
        """Make host memory allocated elsewhere (a region shared by ranks) reachable by the copies of every device of
        this process as `pin_host`'s is (page-locked and portable on CUDA); it stays the allocator's. A range may
        be registered once at a time per process (`HostMemoryAlreadyRegistered`)."""

    def unregister_host(self, buffer: Any) -> None:
        """Undo `register_host`."""
