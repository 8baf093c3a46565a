"""kvfsm's Mooncake client: zero-copy reads and writes of CPU slots, off the engine's thread, each with a deadline.

Every call into Mooncake runs on one daemon I/O thread (its calls release the GIL, so the engine keeps stepping).
The engine only submits and polls: a `Pending` answers `None` until the call returned or its deadline passed, so no
engine step ever waits on the network. A call that outlives its deadline is reported as `StoreTimeout` at once but
may still be reading or writing its slots: `Pending.settled` says when the memory is free again, and the caller must
not reuse a slot before that. When the store is found unreachable, new calls are refused for `retry_after_s`
instead of queueing behind a dead master; too many queued calls are refused with `StoreBusy`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Generic, Sequence, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveFloat, PositiveInt

from kvfsm.mooncake import value
from kvfsm.mooncake.errors import (
    ChecksumMismatch, StoreBusy, StoreCode, StoreTimeout, StoreUnavailable, TierFault, fault_of,
)
from kvfsm.mooncake.local import LOOPBACK, MasterAddress, port_accepts

log = logging.getLogger(__name__)

T = TypeVar("T")
KeyResult = TierFault | None
"""Per key: `None` when the key's bytes were written (or read and verified), else the fault."""


class ClientSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    master: MasterAddress
    local_hostname: str = LOOPBACK
    """The address other Mooncake clients reach this one at (loopback for one host)."""
    segment_bytes: NonNegativeInt = 0
    """Memory this client lends to the store. 0: objects live on segment hosts and survive this engine."""
    transfer_buffer_bytes: PositiveInt = 16 << 20
    """Mooncake's `local_buffer_size`, used only by its copying calls (the zero-copy path registers the pool)."""
    op_timeout_s: PositiveFloat = 2.0
    connect_timeout_s: PositiveFloat = 10.0
    max_pending: PositiveInt = 32
    retry_after_s: PositiveFloat = 1.0


class Pending(Generic[T]):
    """One call on the I/O thread and its deadline."""

    def __init__(self, future: Future[T], deadline: float, on_expiry: Callable[[], None]) -> None:
        self._future = future
        self._deadline = deadline
        self._on_expiry = on_expiry
        self.expired = False

    @classmethod
    def failed(cls, result: T) -> Pending[T]:
        future: Future[T] = Future()
        future.set_result(result)
        return cls(future, 0.0, lambda: None)

    @property
    def settled(self) -> bool:
        """The call returned: the memory it was handed is no longer touched."""
        return self._future.done()

    def poll(self, now: float | None = None) -> T | StoreTimeout | None:
        """The call's answer if it returned in time; `StoreTimeout` once its deadline passed; else `None`."""
        if self.expired:
            return StoreTimeout("the call outlived its deadline")
        if self._future.done():
            return self._future.result()
        if (time.monotonic() if now is None else now) >= self._deadline:
            self.expired = True
            self._on_expiry()
            return StoreTimeout("the call outlived its deadline")
        return None

    def wait(self, timeout_s: float) -> T | StoreTimeout:
        """Block up to `timeout_s` for the answer: for tests, the benchmark and start-up, never an engine step."""
        _wait(self._future, timeout_s)
        answer = self.poll()
        return StoreTimeout("the call outlived its deadline") if answer is None else answer


def _wait(future: Future[object], timeout_s: float) -> None:
    try:
        future.exception(timeout=timeout_s)
    except TimeoutError:
        pass


class SlotRegion:
    """A host buffer cut into slots, plus one value trailer per slot; both registered for zero-copy calls."""

    def __init__(self, buffer: torch.Tensor, slot_bytes: int) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.device.type != "cpu":
            raise ValueError("a slot region is a flat uint8 host tensor")
        if slot_bytes <= 0 or buffer.numel() % slot_bytes:
            raise ValueError(f"{buffer.numel()} bytes do not cut into slots of {slot_bytes}")
        self.buffer = buffer
        self.slot_bytes = slot_bytes
        self.num_slots = buffer.numel() // slot_bytes
        self.trailers = torch.zeros(self.num_slots * value.TRAILER_BYTES, dtype=torch.uint8)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is outside the region's {self.num_slots} slots")

    def payload(self, slot: int) -> np.ndarray:
        self._check(slot)
        return self.buffer[slot * self.slot_bytes:(slot + 1) * self.slot_bytes].numpy()

    def trailer(self, slot: int) -> np.ndarray:
        self._check(slot)
        return self.trailers[slot * value.TRAILER_BYTES:(slot + 1) * value.TRAILER_BYTES].numpy()

    def pointers(self, slot: int) -> list[int]:
        self._check(slot)
        return [self.buffer.data_ptr() + slot * self.slot_bytes,
                self.trailers.data_ptr() + slot * value.TRAILER_BYTES]

    @property
    def sizes(self) -> list[int]:
        return [self.slot_bytes, value.TRAILER_BYTES]


class _IoThread:
    """One daemon thread running submitted calls in order (daemon: a hung call never holds up process exit)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future[object]] | None] = queue.SimpleQueue()
        self._backlog = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvfsm-mooncake-io", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            try:
                future.set_result(call())
            except BaseException as error:  # noqa: BLE001 - handed to the poller, never lost
                future.set_exception(error)
            finally:
                with self._lock:
                    self._backlog -= 1

    @property
    def backlog(self) -> int:
        return self._backlog

    def submit(self, call: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            self._backlog += 1
        self._calls.put((call, future))  # type: ignore[arg-type]
        return future

    def stop(self) -> None:
        self._calls.put(None)


class MooncakeClient:
    """A connected `MooncakeDistributedStore`, driven through `_IoThread` with deadlines."""

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings
        self._store: object | None = None
        self._io = _IoThread()
        self._refuse_until = 0.0
        self._registered: list[int] = []

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Set up the Mooncake client within `connect_timeout_s`, or raise `StoreUnavailable`."""
        from mooncake.store import MooncakeDistributedStore

        s = self.settings
        if not port_accepts(s.master.host, s.master.port, timeout_s=min(1.0, s.connect_timeout_s)):
            raise StoreUnavailable(f"no Mooncake master listens on {s.master}")
        store = MooncakeDistributedStore()
        future = self._io.submit(lambda: store.setup(s.local_hostname, "P2PHANDSHAKE", s.segment_bytes,
                                                     s.transfer_buffer_bytes, "tcp", "", str(s.master)))
        code = Pending(future, time.monotonic() + s.connect_timeout_s, lambda: None).wait(s.connect_timeout_s)
        if code != 0:
            raise StoreUnavailable(f"Mooncake client set-up with {s.master} failed: {code}")
        self._store = store

    def register(self, region: SlotRegion) -> None:
        """Register the region's memory for zero-copy calls (raises `StoreUnavailable` if refused)."""
        for tensor in (region.buffer, region.trailers):
            ptr, size = tensor.data_ptr(), tensor.numel()
            code = self._call_now(lambda: self._require().register_buffer(ptr, size))
            if code != 0:
                raise StoreUnavailable(f"register_buffer of {size} bytes failed: {code}")
            self._registered.append(ptr)

    def close(self) -> None:
        """Unregister, close the client and stop the I/O thread; calls still queued run first."""
        store = self._store
        if store is not None:
            for ptr in self._registered:
                self._io.submit(lambda ptr=ptr: store.unregister_buffer(ptr))  # type: ignore[attr-defined]
            done = self._io.submit(store.close)  # type: ignore[attr-defined]
            _wait(done, self.settings.connect_timeout_s)
        self._registered.clear()
        self._store = None
        self._io.stop()

    def _require(self) -> object:
        if self._store is None:
            raise StoreUnavailable("the Mooncake client is not connected")
        return self._store

    def _call_now(self, call: Callable[[], T]) -> T | TierFault:
        return self._submit(call, fallback=lambda fault: fault).wait(self.settings.op_timeout_s)

    # -- submission ------------------------------------------------------------------------------------------------
    @property
    def backlog(self) -> int:
        """Calls queued or running on the I/O thread."""
        return self._io.backlog

    def _submit(self, call: Callable[[], T], fallback: Callable[[TierFault], T]) -> Pending[T]:
        now = time.monotonic()
        if self._store is None:
            return Pending.failed(fallback(StoreUnavailable("the Mooncake client is not connected")))
        if now < self._refuse_until:
            return Pending.failed(fallback(StoreUnavailable("the store was unreachable moments ago")))
        if self._io.backlog >= self.settings.max_pending:
            return Pending.failed(fallback(StoreBusy(f"{self._io.backlog} calls already queued")))

        def guarded() -> T:
            try:
                return call()
            except TierFault as fault:
                return fallback(fault)

        return Pending(self._io.submit(guarded), now + self.settings.op_timeout_s, self._back_off)

    def _back_off(self) -> None:
        self._refuse_until = time.monotonic() + self.settings.retry_after_s

    def _per_key(self, keys: Sequence[str], codes: Sequence[int], what: str,
                 check: Callable[[int, int], KeyResult]) -> list[KeyResult]:
        results: list[KeyResult] = []
        for index, (key, code) in enumerate(zip(keys, codes, strict=True)):
            if code < 0:
                fault = fault_of(code, f"{what} {key}")
                if code == StoreCode.RPC_FAIL:
                    self._back_off()
                results.append(fault)
            else:
                results.append(check(index, code))
        return results

    # -- operations --------------------------------------------------------------------------------------------
    def write_back(self, region: SlotRegion, keys: Sequence[str], slots: Sequence[int]) -> Pending[list[KeyResult]]:
        """Store each slot's bytes under its key, sealed with a trailer; a key already stored counts as written
        (keys name content, so the object there holds these bytes)."""
        keys, slots = list(keys), list(slots)

        def call() -> list[KeyResult]:
            for key, slot in zip(keys, slots, strict=True):
                value.seal(region.trailer(slot), key, region.payload(slot))
            codes = self._require().batch_put_from_multi_buffers(  # type: ignore[attr-defined]
                keys, [region.pointers(slot) for slot in slots], [region.sizes] * len(keys))
            codes = [0 if code == StoreCode.OBJECT_ALREADY_EXISTS else code for code in codes]
            return self._per_key(keys, codes, "write-back of", lambda _i, _c: None)

        return self._submit(call, fallback=lambda fault: [fault] * len(keys))

    def fetch(self, region: SlotRegion, keys: Sequence[str], slots: Sequence[int]) -> Pending[list[KeyResult]]:
        """Read each key into its slot and verify it; a slot whose result is not `None` holds garbage."""
        keys, slots = list(keys), list(slots)
        expected = region.slot_bytes + value.TRAILER_BYTES

        def verify(index: int, nbytes: int) -> KeyResult:
            try:
                if nbytes != expected:
                    raise ChecksumMismatch(f"{keys[index]}: read {nbytes} bytes, expected {expected}")
                value.check(region.trailer(slots[index]), keys[index], region.payload(slots[index]))
            except TierFault as fault:
                return fault
            return None

        def call() -> list[KeyResult]:
            codes = self._require().batch_get_into_multi_buffers(  # type: ignore[attr-defined]
                keys, [region.pointers(slot) for slot in slots], [region.sizes] * len(keys))
            return self._per_key(keys, codes, "fetch of", verify)

        return self._submit(call, fallback=lambda fault: [fault] * len(keys))

    def contains(self, keys: Sequence[str]) -> Pending[list[bool | TierFault]]:
        """Which keys the store holds now (an answer that may be stale by the time a fetch runs)."""
        keys = list(keys)

        def call() -> list[bool | TierFault]:
            codes = self._require().batch_is_exist(keys)  # type: ignore[attr-defined]
            answers: list[bool | TierFault] = []
            for key, code in zip(keys, codes, strict=True):
                if code < 0:
                    self._back_off()
                    answers.append(StoreUnavailable(f"lookup of {key} failed"))
                else:
                    answers.append(code == 1)
            return answers

        return self._submit(call, fallback=lambda fault: [fault] * len(keys))

    def raw(self) -> object:
        """The underlying `MooncakeDistributedStore`, for the benchmark's baseline and for fault injection."""
        return self._require()
