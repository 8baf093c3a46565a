"""kvfsm's Mooncake client: zero-copy reads and writes of CPU blocks, off the engine's thread, with deadlines.

Every call into Mooncake runs on an I/O executor (by default one daemon thread; Mooncake's calls release the GIL,
so the engine keeps stepping; tests hand in a queue they run by hand). The engine only submits and polls: a
`Pending` answers `None` until its call returned, so no engine step waits on the network (`kvfsm.mooncake.io_thread`).

Deadlines: a call still queued when its deadline passes is cancelled and never runs (`StoreTimeout`), so a slow
or dead store cannot pile up work. A call already running is never abandoned: it may be reading or writing the
memory it was handed, so its answer is reported only once it returned (a dead master answers `RPC_FAIL` within
seconds). Either way the client then refuses new calls for `retry_after_s` instead of queueing behind the store,
and refuses calls beyond `max_pending` with `StoreBusy`.

Threads: `connect`, `register` and `close` run on the caller's thread at start-up and shut-down (`connect` tries the
set-up in a child process first: Mooncake's holds the GIL while it waits); `write_back`, `fetch` and `remove` are
submitted from the tier's thread (the worker's) and run on the I/O executor, in order, followed at `close` by the
teardown that unregisters memory and drops the store handle; `contains` is submitted from the scheduler's thread and
runs on the client's own lookup thread; a fetch's gets run on its get lanes. The back-off (which a MAC thread
reading a fetch's answers sets too) and the backlog (under a lock) are the only state several threads write.

Zero-copy: payloads and trailers are handed over as numpy views of host memory; each is registered with Mooncake
the first time it is seen (`register` registers a whole buffer up front, which covers every view into it;
`kvfsm.mooncake.host_memory` keeps which ranges are registered).

Integrity at transfer speed: every value is sealed and checked with the tenant's MAC (`kvfsm.mooncake.value`) on
`hash_threads` MAC threads (`kvfsm.mooncake.mac_crew`), overlapped with the transfers: a write-back puts every
payload while they seal, and one of them puts the trailers that publish the values once the last seal is done; a
fetch checks each run of values while the next run's get moves (`kvfsm.mooncake.pipeline` cuts the runs,
`kvfsm.mooncake.paced_gets` issues their gets on two get lanes). The I/O thread waits for the last MACs and the
trailers' put before it answers, so a `Pending` never settles while another thread still reads a slot.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import wait
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch

from kvfsm.io_executor import IoExecutor
from kvfsm.mooncake import pipeline, value
from kvfsm.mooncake.errors import (
    ChecksumMismatch, StoreBusy, StoreCode, StoreTimeout, StoreUnavailable, TierFault, fault_of,
)
from kvfsm.mooncake.host_memory import Buffers, Registrations
from kvfsm.mooncake.io_thread import CancellableCall, IoThread, Pending
from kvfsm.mooncake.mac_crew import Crew, MacThreads
from kvfsm.mooncake.paced_gets import GetLanes
from kvfsm.mooncake.settings import ClientSettings
from kvfsm.mooncake.setup_probe import set_up_store
from kvfsm.mooncake.value import ValueMac

log = logging.getLogger(__name__)

T = TypeVar("T")
KeyResult = int | None | TierFault
"""Per key, else its fault: of a write-back, the value's own checksum (`ValueMac.seal`); of a fetch, the block
checksum the verified value carries (None if its writer carried none)."""
Verify = Callable[[np.ndarray, str, np.ndarray], int | None]


class MooncakeClient:
    """A connected `MooncakeDistributedStore`, driven through an I/O executor with deadlines."""

    def __init__(self, settings: ClientSettings, mac: ValueMac, io: IoExecutor | None = None) -> None:
        """`mac`: the tenant's sealer (`kvfsm.mooncake.secret.load_value_key` reads its secret)."""
        self.settings = settings
        self.mac = mac
        self._store: Any = None
        self._io: IoExecutor = io if io is not None else IoThread()
        self._queries = IoThread("kvfsm-mooncake-lookup")
        """Lookups never touch memory the engine owns, so they run on a thread of their own, answering the
        scheduler's bounded wait even when `io` is a queue a test runs by hand."""
        self._refuse_until = 0.0
        self._closing = False
        """`close` began: new calls are refused, while those queued before it still run on the store."""
        self._backlog = 0
        self._lock = threading.Lock()
        self._registered = Registrations()
        self.verify_value: Verify = mac.check
        """How a value read from the store is checked against its trailer, for a fetch and for a key found present
        by a write-back (an attribute so a test's control can drop the MAC)."""
        self._macs = MacThreads(settings.hash_threads or pipeline.default_hash_threads())
        self._gets = GetLanes(settings.get_lead_s)
        self._scratch: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        """Per payload size, memory a write-back reads a value already in the store into, to verify it."""

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Set up the Mooncake client within `connect_timeout_s`, or raise `StoreUnavailable`; at start-up, on the
        caller's thread. Mooncake's set-up holds the GIL while it waits for the master, so it is first tried in a
        child process under the deadline (`kvfsm.mooncake.setup_probe`), and done here only if the master answered."""
        self._store = set_up_store(self.settings)

    def register(self, buffer: torch.Tensor | np.ndarray) -> None:
        """Register a whole host buffer now, so that views into it need no registration later."""
        array = buffer.numpy() if isinstance(buffer, torch.Tensor) else buffer

        def call() -> TierFault | bool:
            self._located([array])
            return True

        result = self._submit(call, fallback=lambda fault: fault).wait(
            self.settings.op_timeout_s + self.settings.connect_timeout_s)
        if result is not True:
            raise result if isinstance(result, TierFault) else StoreUnavailable("register_buffer did not answer")

    def close(self, timeout_s: float | None = None) -> bool:
        """Unregister and close once every call settled; False (and the client kept open, its memory still
        registered) if calls are still running after `timeout_s`: that memory must then outlive the process.

        New calls are refused from here on, but the store is closed only by the teardown, which runs on the I/O
        executor after every call queued before it and waits for the lookups queued before it: those calls still
        find the store they were submitted to open (a closed store's handle must never be called: it crashes)."""
        store = None if self._closing else self._store  # a second close has nothing more to tear down
        self._closing = True
        if store is not None:
            def teardown() -> None:
                self._queries.shutdown(wait=True)
                for start in self._registered.starts():
                    store.unregister_buffer(start)
                store.close()
                self._store = None

            done = self._io.submit(teardown)
            if not isinstance(self._io, IoThread):
                self._io.shutdown(wait=True)  # an executor handed in (a test's queue) runs what it holds now
            try:
                done.result(timeout=self.settings.connect_timeout_s if timeout_s is None else timeout_s)
            except TimeoutError:
                log.error("Mooncake client: calls still running at close; its registered memory stays in use")
                return False
        if isinstance(self._io, IoThread):
            self._io.shutdown(wait=False)
        self._queries.shutdown(wait=False)
        self._gets.shutdown()
        self._macs.shutdown()
        return True

    @property
    def hash_threads(self) -> int:
        """The client's MAC threads."""
        return self._macs.count

    @property
    def connected(self) -> bool:
        return self._store is not None and not self._closing

    @property
    def backlog(self) -> int:
        """Calls submitted and not yet returned or cancelled."""
        return self._backlog

    def raw(self) -> Any:
        """The underlying `MooncakeDistributedStore`, for the benchmark's baseline and for fault injection."""
        if self._store is None:
            raise StoreUnavailable("the Mooncake client is not connected")
        return self._store

    # -- submission -----------------------------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], T], fallback: Callable[[TierFault], T],
                executor: IoExecutor | None = None) -> Pending[T]:
        now = time.monotonic()
        if not self.connected:
            return Pending.answered(fallback(StoreUnavailable("the Mooncake client is not connected")))
        if now < self._refuse_until:
            return Pending.answered(fallback(StoreUnavailable("the store was unreachable or slow moments ago")))
        if self._backlog >= self.settings.max_pending:
            return Pending.answered(fallback(StoreBusy(f"{self._backlog} calls already pending")))

        def guarded() -> T:
            try:
                return fn()
            except TierFault as fault:
                return fallback(fault)
            finally:
                self._count(-1)

        timed_out = fallback(StoreTimeout(f"still queued after {self.settings.op_timeout_s}s"))

        def cancelled() -> T:
            self._count(-1)
            return timed_out

        call = CancellableCall(guarded, cancelled)
        self._count(+1)
        future = (executor or self._io).submit(call)
        return Pending(future, call, now + self.settings.op_timeout_s, self._back_off, timed_out)

    def _count(self, delta: int) -> None:
        with self._lock:
            self._backlog += delta

    def _back_off(self) -> None:
        self._refuse_until = time.monotonic() + self.settings.retry_after_s

    def _located(self, arrays: Sequence[np.ndarray]) -> Buffers:
        return self._registered.locate(arrays, self._register)

    def _register(self, start: int, size: int) -> None:
        code = self._store.register_buffer(start, size)
        if code != 0:
            raise StoreUnavailable(f"register_buffer of {size} bytes failed: {code}")

    def _faults(self, keys: Sequence[str], codes: Sequence[int], what: str, read: bool = False
                ) -> list[TierFault | None]:
        """Per key, the fault of its answer in `codes` (of a read if `read`: `kvfsm.mooncake.errors.fault_of`)."""
        faults: list[TierFault | None] = []
        for key, code in zip(keys, codes, strict=True):
            if code < 0 and code != StoreCode.OBJECT_ALREADY_EXISTS:
                if code == StoreCode.RPC_FAIL:
                    self._back_off()
                faults.append(fault_of(code, f"{what} {key}", read))
            else:
                faults.append(None)
        return faults

    # -- operations -----------------------------------------------------------------------------------------------
    def write_back(self, keys: Sequence[str], payloads: Sequence[np.ndarray], trailers: Sequence[np.ndarray],
                   units: Sequence[np.ndarray] = (), carried: Sequence[int | None] = ()
                   ) -> Pending[list[KeyResult]]:
        """Store each payload under its key and its trailer, sealed with the tenant's MAC and carrying `carried[i]`
        (the block's own checksum) if given, under the key's trailer key (`kvfsm.mooncake.value`); the trailers'
        put publishes the values. A trailer put over a payload the store then refused is removed again. `units` are
        buffers to register whole before the first use of views into them.

        What the store holds already is asked first (one `batch_is_exist`): Mooncake answers success to a put onto
        a present key and keeps the value there. A key held whole counts as written only once the value there
        verifies (this tenant wrote it: keys name content, so it holds these bytes), else `ChecksumMismatch`; a
        key of which the store holds one half (a write-back that stopped between its puts, an eviction, a plant)
        has that half removed before this one's puts, so what is published is this tenant's payload. A value
        planted between the query and a put is still refused by every fetch of it (docs/security.md)."""
        keys, payloads, trailers = list(keys), list(payloads), list(trailers)
        sums = list(carried) or [None] * len(keys)

        def seal(i: int) -> int:
            return self.mac.seal(trailers[i], keys[i], payloads[i], sums[i])

        def call() -> list[KeyResult]:
            with self._macs.crew(seal) as sealing:  # first: the MAC threads start now
                sealing.hand(range(len(keys)))
                sealing.close()
                self._located(units)
                return put(sealing, self._located(payloads), self._located(trailers))

        def put(sealing: Crew[int], payload_at: Buffers, trailer_at: Buffers) -> list[KeyResult]:
            answers: dict[int, KeyResult] = {}
            whole, halves = [], []
            for i, (payload, trailer) in enumerate(self._halves(keys)):
                if payload < 0 or trailer < 0:
                    answers[i] = self._unanswered(keys[i])
                elif payload and trailer:
                    whole.append(i)
                elif payload or trailer:
                    halves.append(i)
            answers.update(self._cleared(keys, halves))
            fresh = [i for i in range(len(keys)) if i not in answers and i not in whole]
            trailer_names = [value.trailer_key(keys[i]) for i in fresh]

            def publish() -> tuple[dict[int, int], list[TierFault | None]]:
                sealed = sealing.results()  # a seal that failed raises here: no trailer of this call is put
                return sealed, self._put(trailer_names, trailer_at.pick(fresh))

            published = self._macs.submit(publish)
            try:
                payload_faults = self._put([keys[i] for i in fresh], payload_at.pick(fresh))
            finally:
                wait([published])
            sealed, trailer_faults = published.result()
            orphans = []
            for i, name, payload_fault, trailer_fault in zip(fresh, trailer_names, payload_faults, trailer_faults):
                answers[i] = payload_fault or trailer_fault or sealed[i]
                if payload_fault is not None and trailer_fault is None:
                    orphans.append(name)
            if orphans:  # not removed (its answer lost), such a trailer is a half the key's next write-back clears
                self._store.batch_remove(orphans, True)
            answers.update((i, self._verify_present(keys[i], payloads[i].nbytes)) for i in whole)
            return [answers[i] for i in range(len(keys))]

        return self._submit(call, fallback=lambda fault: [fault] * len(keys))

    def _halves(self, keys: list[str]) -> list[tuple[int, int]]:
        """Per key, the store's answers (1 held, 0 not, negative: no answer) for its payload and its trailer."""
        return value.per_key(self._store.batch_is_exist(value.object_names(keys)))

    def _cleared(self, keys: list[str], halves: list[int]) -> dict[int, KeyResult]:
        """Remove both halves of `halves`' keys; the fault of each key a half of which could not be removed."""
        if not halves:
            return {}
        names = value.object_names([keys[i] for i in halves])
        codes = [StoreCode.OK if code == StoreCode.OBJECT_NOT_FOUND else code
                 for code in self._store.batch_remove(names, True)]
        faults = self._faults(names, codes, "removal of half a value under")
        return {i: fault for i, fault in zip(halves, value.first_per_key(faults)) if fault is not None}

    def _put(self, names: list[str], buffers: Buffers) -> list[TierFault | None]:
        """One put of `buffers` under `names`; per name, its fault."""
        if not names:
            return []
        return self._faults(names, self._store.batch_put_from(names, buffers.at, buffers.sizes), "write-back of")

    def _unanswered(self, key: str) -> TierFault:
        """A key whose presence the store did not answer is not put (a stalled master would make the put wait out
        its RPC timeout a second time); the store is refused for a while, as after any failed call."""
        self._back_off()
        return StoreUnavailable(f"write-back of {key}: the store did not say whether it holds the key")

    def _get(self, keys: list[str], payloads: Buffers, trailers: Buffers) -> list[tuple[int, int]]:
        """One get of each key's payload and trailer into `payloads` and `trailers`; per key, the store's answers
        for its payload and its trailer (`_checked` reads them)."""
        return value.per_key(self._store.batch_get_into(value.object_names(keys), payloads.at + trailers.at,
                                                        payloads.sizes + trailers.sizes))

    def _checked(self, key: str, payload: np.ndarray, trailer: np.ndarray, halves: tuple[int, int], what: str
                 ) -> KeyResult:
        """The verdict on `key`'s value read into `payload` and `trailer`, given the store's answers for its two
        halves: the first fault of those, else a short read, else what the MAC check says."""
        [fault] = value.first_per_key(self._faults([key, key], halves, what, read=True))
        expected = payload.nbytes + value.TRAILER_BYTES
        if fault is None and sum(halves) != expected:
            fault = ChecksumMismatch(f"{key}: read {sum(halves)} bytes, expected {expected}")
        try:
            return fault or self.verify_value(trailer, key, payload)
        except TierFault as failed:
            return failed

    def _verify_present(self, key: str, nbytes: int) -> KeyResult:
        """The own checksum of the value already stored under `key` once it verifies, else the fault: a key another
        client planted is never counted as written by this tenant."""
        if nbytes not in self._scratch:
            scratch = torch.zeros(nbytes + value.TRAILER_BYTES, dtype=torch.uint8).numpy()
            self._scratch[nbytes] = (scratch[:nbytes], scratch[nbytes:])
        payload, trailer = self._scratch[nbytes]
        [halves] = self._get([key], self._located([payload]), self._located([trailer]))
        answer = self._checked(key, payload, trailer, halves, "check of the value present under")
        return answer if isinstance(answer, TierFault) else self.mac.checksum_of(trailer)

    def fetch(self, keys: Sequence[str], payloads: Sequence[np.ndarray], trailers: Sequence[np.ndarray],
              units: Sequence[np.ndarray] = ()) -> Pending[list[KeyResult]]:
        """Read each key's payload and trailer and verify its MAC; a payload whose result is a fault holds garbage
        and must not be used. The MAC threads check each run that landed, and the I/O thread beside them at the end."""
        keys, payloads, trailers = list(keys), list(payloads), list(trailers)
        landed: dict[int, tuple[int, int]] = {}
        """Per key whose get returned, the store's answers for its two halves (written before it is handed over)."""

        def check(i: int) -> KeyResult:
            return self._checked(keys[i], payloads[i], trailers[i], landed[i], "fetch of")

        def call() -> list[KeyResult]:
            self._located(units)
            payload_at, trailer_at = self._located(payloads), self._located(trailers)
            least = pipeline.round_values(payload_at.sizes, self.hash_threads, self.settings.pipeline_bytes)
            runs = pipeline.fetch_runs(len(keys), least, self.hash_threads)

            def get(run: range) -> list[tuple[int, int]]:
                return self._get([keys[i] for i in run], payload_at.pick(run), trailer_at.pick(run))

            def hand(run: range, answers: list[tuple[int, int]]) -> None:
                landed.update(zip(run, answers))
                checking.hand(run)

            with self._macs.crew(check) as checking:
                self._gets.run(runs, [sum(payload_at.pick(run).sizes) for run in runs], get, hand)
                checked = checking.join()
            return [checked[i] for i in range(len(keys))]

        return self._submit(call, fallback=lambda fault: [fault] * len(keys))

    def remove(self, keys: Sequence[str]) -> Pending[list[TierFault | None]]:
        """Remove values (payload and trailer) from the store even if others hold read leases on them (for values
        found corrupt); a key's answer is the first fault of its two halves."""
        keys = list(keys)

        def call() -> list[TierFault | None]:
            names = value.object_names(keys)
            return value.first_per_key(self._faults(names, self._store.batch_remove(names, True), "removal of"))

        return self._submit(call, fallback=lambda fault: [fault] * len(keys))

    def contains(self, keys: Sequence[str]) -> Pending[list[bool | TierFault]]:
        """Which keys the store holds whole now, payload and trailer (an answer that may be stale by the time a fetch
        runs)."""
        keys = list(keys)

        def call() -> list[bool | TierFault]:
            answers: list[bool | TierFault] = []
            for key, (payload, trailer) in zip(keys, self._halves(keys), strict=True):
                if payload < 0 or trailer < 0:
                    self._back_off()
                    answers.append(StoreUnavailable(f"lookup of {key} failed"))
                else:
                    answers.append(payload == trailer == 1)
            return answers

        return self._submit(call, fallback=lambda fault: [fault] * len(keys), executor=self._queries)
