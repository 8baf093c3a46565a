"""A deterministic virtual GPU whose schedule the caller picks.

Real streams run concurrently and the order in which their operations interleave is up to the hardware. The
simulator keeps each stream as a FIFO of operations over CPU tensors and lets the caller (or `scheduler`) choose
which runnable stream advances next, so every interleaving a GPU could produce is reachable on demand and none that
it could not: an operation runs only at the head of its stream and only once every event it waits on is done. A
missing `wait` is therefore a race that some schedule exposes, and the access log lets the spec's ordering
invariants say which rule it broke.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from kvfsm.executor.device import STREAMS, HostMemoryAlreadyRegistered, StreamName, Touch
from kvfsm.executor.access import Access, Actor

Scheduler = Callable[[list[StreamName]], StreamName]


class SimDeadlock(RuntimeError):
    """The host waits for an event that no schedule can ever reach."""


class SimScheduleError(ValueError):
    """A stream was asked to advance although its head operation cannot run."""


class UnknownHostBuffer(ValueError):
    """`unpin_host` was given a buffer this device did not allocate (or already released)."""


_PROCESS_REGISTERED: dict[int, int] = {}
"""Host ranges registered by any SimDevice of this process and not released (first byte: byte past the end): the
CUDA driver keeps one such table per process, whichever device registered a range."""


def first_runnable(runnable: list[StreamName]) -> StreamName:
    """The default schedule: always advance the first runnable stream in the order compute, store, load."""
    return runnable[0]


@dataclass(eq=False)
class _Op:
    """One enqueued operation; markers (event records) and waits are operations with no work of their own."""

    issued: int
    actor: Actor
    label: str
    fn: Callable[[], None] | None = None
    touches: tuple[Touch, ...] = ()
    after: _Op | None = None  # the event record this operation waits for
    done: bool = False


@dataclass(eq=False)
class SimEvent:
    """An event: `latest` is the marker of its most recent record (CUDA binds waits and queries to it)."""

    latest: _Op | None = field(default=None)


class SimDevice:
    """The `Device` protocol on the CPU, with a caller-chosen schedule and a log of every executed access."""

    kind = "sim"

    def __init__(self, scheduler: Scheduler = first_runnable) -> None:
        self.scheduler: Scheduler = scheduler
        self.accesses: list[Access] = []
        self._queues: dict[StreamName, deque[_Op]] = {s: deque() for s in STREAMS}
        self._running: set[StreamName] = set()
        self._issued = 0
        self._executed = 0
        self._host_buffers: dict[int, torch.Tensor] = {}
        self._registered: dict[int, tuple[int, weakref.finalize]] = {}
        """Host memory allocated elsewhere and registered (`register_host`) by this device: bytes by data pointer,
        and the finalizer that drops the range from the process's table should the buffer die unreleased (its
        address may then be handed out again, and a later registration there is no clash)."""
        self.peers: list[SimDevice] = []
        """Other devices this one's streams wait on (tensor-parallel ranks in one process, whose all-reduce waits
        for every rank's forward): when none of this device's streams can run, a host wait advances a peer's, by
        the peer's own schedule."""

    def tensor_device(self) -> torch.device:
        return torch.device("cpu")

    # -- enqueueing ---------------------------------------------------------------------------------------------

    def _push(self, stream: StreamName, op_factory: Callable[[int], _Op]) -> _Op:
        self._issued += 1
        op = op_factory(self._issued)
        self._queues[stream].append(op)
        return op

    def new_event(self) -> SimEvent:
        return SimEvent()

    def record(self, stream: StreamName, event: SimEvent) -> None:
        event.latest = self._push(stream, lambda n: _Op(n, stream, f"record on {stream}"))

    def wait(self, stream: StreamName, event: SimEvent) -> None:
        marker = event.latest
        if marker is None:  # CUDA: waiting on an event that was never recorded is a no-op
            return
        self._push(stream, lambda n: _Op(n, stream, f"wait on {stream}", after=marker))

    def enqueue(self, stream: StreamName, actor: Actor, label: str, fn: Callable[[], None],
                touches: Iterable[Touch] = ()) -> None:
        touched = tuple(touches)
        self._push(stream, lambda n: _Op(n, actor, label, fn=fn, touches=touched))

    # -- running ------------------------------------------------------------------------------------------------

    def runnable(self) -> list[StreamName]:
        """Streams whose head operation may run now, in the order compute, store, load."""
        return [
            s for s in STREAMS
            if self._queues[s] and s not in self._running
            and (self._queues[s][0].after is None or self._queues[s][0].after.done)
        ]

    def run_one(self, stream: StreamName) -> None:
        """Run the head operation of `stream`; while it runs its stream is busy (host blocking inside it sees that)."""
        if stream not in self.runnable():
            raise SimScheduleError(f"stream {stream!r} has no runnable operation (runnable: {self.runnable()})")
        op = self._queues[stream][0]
        self._running.add(stream)
        try:
            if op.fn is not None:
                op.fn()
        finally:
            self._running.discard(stream)
            self._queues[stream].popleft()
            self._executed += 1
            op.done = True
        self.accesses.extend(
            Access(op.issued, self._executed, op.actor, touch.mode, touch.space, block, op.label, touch.layer)
            for touch in op.touches
            for block in touch.blocks
        )

    def _step(self, choose: Scheduler, what: str) -> None:
        options = self.runnable()
        if options:
            self.run_one(choose(options))
            return
        for peer in self.peers:
            if peer_options := peer.runnable():
                peer.run_one(peer.scheduler(peer_options))
                return
        raise SimDeadlock(f"{what}, but no stream can make progress")

    def run_until_idle(self, choose: Scheduler | None = None) -> None:
        """Drive every stream to empty, picking each step with `choose` (default: `self.scheduler`)."""
        chooser = choose or self.scheduler
        while not self.idle:
            self._step(chooser, "operations remain queued")

    @property
    def idle(self) -> bool:
        return not any(self._queues.values())

    def query(self, event: SimEvent) -> bool:
        return event.latest is None or event.latest.done

    def synchronize(self, event: SimEvent) -> None:
        """Block the host: advance streams chosen by `self.scheduler` until the event's latest record ran."""
        marker = event.latest
        while marker is not None and not marker.done:
            self._step(self.scheduler, f"the host waits for {marker.label} (issued #{marker.issued})")

    def queued(self) -> dict[StreamName, list[str]]:
        """Per stream (in the order compute, store, load), the labels of the operations still queued on it, running
        or not, in issue order: what a test asserts has (not) gone out yet and what a state explorer tells states
        apart by, read without reaching into the queues. The lists are fresh copies, so changing them changes
        nothing here."""
        return {stream: [op.label for op in queue] for stream, queue in self._queues.items()}

    # -- the access log -----------------------------------------------------------------------------------------

    def oldest_queued(self) -> int:
        """The `issued` number of the oldest operation still queued on any stream (running or not), or one past the
        last issued when none is queued: every operation issued before it has run, and every one that runs from now
        on was issued at or after it, so it bounds what `forget_accesses_before` may drop. (Each stream is a FIFO
        in issue order, so its head is its oldest.)"""
        return min((queue[0].issued for queue in self._queues.values() if queue), default=self._issued + 1)

    def forget_accesses_before(self, issued: int) -> None:
        """Drop from `accesses` the entries of operations issued before `issued`, keeping the rest in order, so that
        checks re-reading the log after every step cost what is in flight rather than the whole run.

        Safe only with `issued` at most `oldest_queued()` and only once the ordering invariants have judged the log
        as it stands: those operations all ran, and whatever runs later was issued after them, so no later access
        can overtake one of theirs and the invariants have nothing more to find in them. Dropped any earlier, a race
        between them and an operation still queued would go unseen."""
        self.accesses[:] = [access for access in self.accesses if access.issued >= issued]

    # -- host memory --------------------------------------------------------------------------------------------

    def pin_host(self, nbytes: int) -> torch.Tensor:
        if nbytes <= 0:
            raise ValueError(f"a host allocation needs a positive size, got {nbytes}")
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self._host_buffers[buffer.data_ptr()] = buffer
        return buffer

    def unpin_host(self, buffer: torch.Tensor) -> None:
        if self._host_buffers.pop(buffer.data_ptr(), None) is None:
            raise UnknownHostBuffer("this buffer was not allocated by pin_host, or was already released")

    def register_host(self, buffer: torch.Tensor) -> None:
        """As CUDA does, refuse a range that overlaps one registered by any device of the process."""
        start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
        clash = next((first for first, last in _PROCESS_REGISTERED.items() if first < end and start < last), None)
        if clash is not None:
            raise HostMemoryAlreadyRegistered(
                f"host bytes [{start:#x}, {end:#x}) overlap [{clash:#x}, {_PROCESS_REGISTERED[clash]:#x}), "
                "registered in this process and not released")
        _PROCESS_REGISTERED[start] = end
        self._registered[start] = (buffer.numel(), weakref.finalize(buffer, _PROCESS_REGISTERED.pop, start, None))

    def unregister_host(self, buffer: torch.Tensor) -> None:
        registered = self._registered.pop(buffer.data_ptr(), None)
        if registered is None:
            raise UnknownHostBuffer("this buffer was not registered by register_host, or was already unregistered")
        registered[1]()  # drops the range from the process's table, once

    @property
    def registered_bytes(self) -> int:
        """Bytes of host memory allocated elsewhere and registered now by this device (a shared region's mapping)."""
        return sum(nbytes for nbytes, _ in self._registered.values())

    @property
    def host_bytes(self) -> int:
        """Bytes currently held through `pin_host`: what a leak check looks at."""
        return sum(b.numel() for b in self._host_buffers.values())
