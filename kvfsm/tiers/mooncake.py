"""A shared tier on Mooncake Store: one more `LowerTier`, whose keys other engines (other processes, other hosts)
write and read too.

How it differs from the disk tier, and why:
- Keys are the store's: a block's prefix hash becomes an object key that also names the model, KV dtype and layout,
  block size, tensor-parallel rank and world, and the tenant (`kvfsm.mooncake.keys`), so engines that must not
  share KV never can. Capacity and eviction are the store's; a key it evicted between lookup and fetch is a miss.
- With `kv_heads` configured a block is one value per KV head instead, keyed by the head and no TP rank or size
  (`kvfsm.mooncake.heads`): each rank moves its own heads' values through a head-major shadow of the slot, and a
  lookup counts a block only when every head of it is in the store, so engines of every TP size share prefixes.
- A lookup asks the store (one `batch_is_exist`, waited at most `lookup_timeout_s` on the scheduler's thread) for
  the keys this process does not know; a key it shows complete is *adopted* (`tier-entry` `adopt`): the store
  exposes an object only once its put ended, and the value carries its own sealed checksum.
- Bytes move zero-copy between the CPU slots and the store (`kvfsm.mooncake.client`), each value sealed with a
  trailer (the tenant's keyed MAC over key, length, the block's own checksum and bytes) and checked on read: a
  forged, foreign, torn or corrupted value is `corrupt`, a miss the engine recomputes, counted in the planner's
  `failures["corrupt"]` and in `rejected_values` here; its bytes never leave the CPU slot the fetch claimed. A key
  a write-back finds present already is published only once the value there verifies.
- All calls run on the client's I/O executor; a call still queued at its deadline is cancelled (`timeout`); one
  already running is reported failed at its deadline with `held=True` (the engine recomputes at once) and released
  when it returns, since until then it may still touch the CPU slot. After a failure the client refuses calls at
  once for a while, so a dead or slow master costs misses, never a blocked engine step.
- `discard` forgets keys locally; it never removes them from the shared store, where other engines may use them.
  The local index remembers at most `index_keys` published keys (least recently used forgotten first): the store
  may hold far more than one engine ever needs again, and a forgotten key is adopted again by a lookup that meets it.
- Jobs and the poll loop are `kvfsm.tiers.base.TierJobs`'s, as for every tier; a job's deadline is its client
  call's (`Pending.deadline`). This module keeps only the keys, the values' trailers and the client.

Threads: the worker's thread submits, polls, discards and closes; the scheduler's thread looks up (its store query
runs on the client's lookup thread and is waited for at most `lookup_timeout_s`); the client's I/O executor runs
every write-back and fetch, which touch the CPU slots and trailers they were handed and nothing of the index.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from kvfsm.config import MooncakeTierConfig
from kvfsm.executor.layouts import KVCaches
from kvfsm.io_executor import IoExecutor
from kvfsm.machines import MachineSet
from kvfsm.mooncake import value
from kvfsm.mooncake.client import KeyResult, MooncakeClient
from kvfsm.mooncake.errors import ChecksumMismatch, KeyMissing, StoreFull, StoreTimeout, TierFault
from kvfsm.mooncake.heads import HeadCalls, HeadsDoNotSplit, HeadSplit
from kvfsm.mooncake.io_thread import Pending
from kvfsm.mooncake.keys import KvNamespace, head_key, object_key
from kvfsm.mooncake.local import MasterAddress
from kvfsm.mooncake.secret import load_value_key
from kvfsm.mooncake.settings import ClientSettings
from kvfsm.mooncake.value import ValueMac
from kvfsm.tier_records import TierEntry
from kvfsm.states import TierEntryState as Entry
from kvfsm.tiers.base import IoJob, IoKind, JobCalls, TierCompletion, TierFailure, TierJobs, TierSite
from kvfsm.tiers.entries import TierEntries

log = logging.getLogger(__name__)

TRAILERS_PER_CHUNK = 1024
SHADOW_CHUNK_BYTES = 16 << 20
"""Head-major shadows of CPU slots are allocated and registered with Mooncake in chunks of about this size."""
HEADED_LAYOUTS = frozenset({"kv-first", "blocks-first"})
"""Layouts whose blocks are rows of (heads, head dim): the ones that store one value per KV head."""


def failure_of(fault: BaseException) -> TierFailure | None:
    """The tier-level reason for a named Mooncake fault; None for any other error (not a store outcome: a bug)."""
    if not isinstance(fault, TierFault):
        return None
    if isinstance(fault, KeyMissing):
        return TierFailure.missing
    if isinstance(fault, ChecksumMismatch):
        return TierFailure.corrupt
    if isinstance(fault, StoreFull):
        return TierFailure.full
    if isinstance(fault, StoreTimeout):
        return TierFailure.timeout
    return TierFailure.io_error


class SlotArena:
    """One buffer of `item_bytes` per payload address (a value trailer, a slot's head-major shadow), in chunks of
    `per_chunk` registered whole with Mooncake (slots are fixed addresses, so a payload keeps its buffer for the
    life of the tier)."""

    def __init__(self, item_bytes: int, per_chunk: int) -> None:
        self.item_bytes = item_bytes
        self.per_chunk = per_chunk
        self._chunks: list[np.ndarray] = []
        self._of_address: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def item_for(self, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The buffer of the payload `payload` starts, and the chunk holding it (to register whole)."""
        start = int(payload.ctypes.data)
        if start not in self._of_address:
            index = len(self._of_address)
            if index % self.per_chunk == 0:
                self._chunks.append(torch.zeros(self.per_chunk * self.item_bytes, dtype=torch.uint8).numpy())
            chunk = self._chunks[-1]
            offset = (index % self.per_chunk) * self.item_bytes
            self._of_address[start] = (chunk[offset:offset + self.item_bytes], chunk)
        return self._of_address[start]


class MooncakeTier:
    """A `LowerTier` on a Mooncake Store shared with other engines."""

    def __init__(self, name: str, client: MooncakeClient, namespace: KvNamespace, block_bytes: int, *,
                 tenant: str | None, lookup_timeout_s: float, keep_lookups: bool, pool: np.ndarray, index_keys: int,
                 machines: MachineSet, heads: HeadSplit | None) -> None:
        """`machines`: the connector's machine set, which fires this tier's `tier-entry` transitions; `index_keys`:
        how many published keys of the store this tier remembers (`MooncakeTierConfig.index_keys`); `heads`: this
        rank's share of the KV heads, to store one value per head (None: one value per CPU block). No defaults:
        `open_mooncake` passes each from the config, which holds the defaults."""
        self.name = name
        self.block_bytes = block_bytes
        self.entries = TierEntries(name, machines, keep_lookups=keep_lookups, bound=index_keys)
        self.client = client
        self.namespace = namespace
        self.tenant = tenant
        self.lookup_timeout_s = lookup_timeout_s
        self.heads = heads
        self.index_keys = index_keys
        self._trailers = SlotArena(value.TRAILER_BYTES, TRAILERS_PER_CHUNK)
        self._shadows = SlotArena(block_bytes, max(1, SHADOW_CHUNK_BYTES // block_bytes))
        self._pool_units = [pool]
        """Registered whole with the first call, so every slot view handed in later is covered."""
        self._jobs = TierJobs(f"mooncake tier {name!r}", self.entries, block_bytes, failure_of, self._settled)
        self._shunned: OrderedDict[int, None] = OrderedDict()
        """Keys whose stored value failed its check: not adopted again until this tier writes them itself (their
        removal from the store is requested, but other engines may race it). At most `index_keys`, oldest forgotten
        first: a forgotten one costs one more failed fetch if the bad value is still there."""
        self.rejected_values = 0
        """Values read from the store (by a fetch, or found present by a write-back) whose MAC did not verify."""

    def store_key(self, key: int) -> str:
        return object_key(self.namespace, key, self.tenant)

    def store_keys(self, key: int) -> list[str]:
        """The store keys this rank writes and reads for a block: one per head it holds, or its block's."""
        return self._keys(key, None if self.heads is None else self.heads.heads)

    def _whole_block_keys(self, key: int) -> list[str]:
        """The store keys that hold all of a block: every KV head's (a lookup's hit needs each), or this rank's."""
        return self._keys(key, None if self.heads is None else range(self.heads.kv_heads))

    def _keys(self, key: int, heads: range | None) -> list[str]:
        if heads is None:
            return [self.store_key(key)]
        return [head_key(self.namespace, key, head, self.tenant) for head in heads]

    # --- LowerTier -------------------------------------------------------------------------------------------

    @property
    def plan_version(self) -> None:
        """Never: every lookup may find keys other engines wrote."""
        return None

    def lookup(self, keys: Sequence[int]) -> int:
        count = self.entries.published_prefix(keys)
        if count < len(keys) and self.entries.get(keys[count]) is None:
            self._adopt_from_store(keys[count:])
        return self.entries.lookup(keys)

    def submit_write(self, job_id: int, keys: Sequence[int], sources: Sequence[memoryview],
                     checksums: Sequence[int | None] = ()) -> None:
        self._jobs.check(job_id, keys, sources)
        entries, payloads, carried = [], [], []
        for key, view, checksum in zip(keys, sources, checksums or [None] * len(keys)):
            entry = self.entries.reserve(key)
            if entry is not None:  # a key published or being written already counts as moved
                entries.append(entry)
                payloads.append(np.frombuffer(view, dtype=np.uint8))
                carried.append(checksum)
        self._jobs.start(job_id, IoJob("write", entries, self._submit("write", entries, payloads, carried)))

    def submit_read(self, job_id: int, keys: Sequence[int], destinations: Sequence[memoryview]) -> None:
        self._jobs.check(job_id, keys, destinations)
        entries, payloads, failed = [], [], {}
        for key, view in zip(keys, destinations):
            entry = self.entries.pin(key)
            if entry is None:
                failed[key] = TierFailure.missing
                continue
            entries.append(entry)
            payloads.append(np.frombuffer(view, dtype=np.uint8))
        self._jobs.start(job_id, IoJob("read", entries, self._submit("read", entries, payloads), failed))

    def poll(self) -> list[TierCompletion]:
        return self._jobs.poll()

    def discard(self, keys: Sequence[int]) -> None:
        """Forget `keys` here; the shared store keeps them for the other engines."""
        for key in keys:
            self.entries.evict(key)

    def close(self) -> None:
        self.client.close()

    # --- inspection ------------------------------------------------------------------------------------------

    def stored_bytes(self, key: int) -> bytes | None:
        """The payload the store holds under `key` now (for checks; it does not verify): with `heads`, this rank's
        heads' values put back in the order of its CPU slot."""
        if self.heads is None:
            raw = self.client.raw().get(self.store_key(key))
            return bytes(raw) if len(raw) == self.block_bytes else None
        shadow, block = np.empty(self.block_bytes, np.uint8), np.empty(self.block_bytes, np.uint8)
        for head_value, store_key in zip(self.heads.values(shadow), self.store_keys(key)):
            raw = self.client.raw().get(store_key)
            if len(raw) != head_value.nbytes:
                return None
            head_value[:] = np.frombuffer(raw, np.uint8)
        self.heads.from_shadow(shadow, block)
        return block.tobytes()

    @property
    def busy(self) -> bool:
        return self._jobs.busy

    def reads_in_flight(self) -> list[int]:
        return self._jobs.reads_in_flight()

    # --- helpers ---------------------------------------------------------------------------------------------

    def _adopt_from_store(self, keys: Sequence[int]) -> None:
        """Adopt the leading `keys` the store shows complete, if it answers within `lookup_timeout_s`."""
        per_block = [self._whole_block_keys(key) for key in keys]
        answers = self.client.contains([k for block in per_block for k in block]).wait(self.lookup_timeout_s)
        if answers is None:
            log.warning("mooncake tier %s: lookup got no answer within %ss; counted as a miss", self.name,
                        self.lookup_timeout_s)
            return
        width = len(per_block[0]) if per_block else 1
        shown: list[int] = []
        for index, key in enumerate(keys):
            block = answers[index * width:(index + 1) * width]
            fault = next((a for a in block if isinstance(a, TierFault)), None)
            if fault is not None:
                log.warning("mooncake tier %s: lookup: %s: %s", self.name, type(fault).__name__, fault)
                break
            entry = self.entries.get(key)
            if (not all(answer is True for answer in block) or key in self._shunned
                    or (entry is not None and entry.state != Entry.PUBLISHED)):
                break
            shown.append(key)
        for key in reversed(shown):  # the head adopted last: the most recently used, the last `index_keys` forgets
            if self.entries.get(key) is None:
                self.entries.adopt(key)

    def _submit(self, kind: IoKind, entries: list[TierEntry], payloads: list[np.ndarray],
                carried: Sequence[int | None] = ()) -> JobCalls:
        if not entries:
            return Pending.answered([])
        if self.heads is None:
            return self._call(kind, [self.store_key(entry.key) for entry in entries], payloads, [], carried)
        # A head's value carries no block checksum: a block's checksum covers one rank's heads, which another TP
        # size splits differently. Its MAC covers its bytes; the reader's CPU pool checksums the landed block.
        heads = self.heads
        shadows = [self._shadows.item_for(payload) for payload in payloads]
        if kind == "write":  # the slot is pinned writing-back: its bytes hold still while copied
            for payload, (shadow, _) in zip(payloads, shadows):
                heads.to_shadow(payload, shadow)
        keys = [k for entry in entries for k in self.store_keys(entry.key)]
        values = [v for shadow, _ in shadows for v in heads.values(shadow)]
        call = self._call(kind, keys, values, [chunk for _, chunk in shadows])

        def landed(index: int) -> None:  # every head of the entry arrived and passed its check
            heads.from_shadow(shadows[index][0], payloads[index])

        return HeadCalls(call, heads.local_heads, landed if kind == "read" else None)

    def _call(self, kind: IoKind, keys: list[str], payloads: list[np.ndarray], chunks: list[np.ndarray],
              carried: Sequence[int | None] = ()) -> Pending[list[KeyResult]]:
        """One client call moving each payload under its key, each with its trailer (and, written, the block
        checksum `carried[i]`)."""
        pairs = [self._trailers.item_for(payload) for payload in payloads]
        trailers = [t for t, _ in pairs]
        units = self._pool_units + list({id(c): c for c in chunks + [c for _, c in pairs]}.values())
        if kind == "write":
            return self.client.write_back(keys, payloads, trailers, units=units, carried=carried)
        return self.client.fetch(keys, payloads, trailers, units=units)

    def _settled(self, kind: IoKind, entry: TierEntry, failure: TierFailure | None) -> None:
        if failure is TierFailure.corrupt:  # the stored value failed its check: never adopt it again
            self.rejected_values += 1
            self._shunned[entry.key] = None
            while len(self._shunned) > self.index_keys:
                self._shunned.popitem(last=False)
            self.client.remove(self.store_keys(entry.key))
        elif failure is None and kind == "write":
            self._shunned.pop(entry.key, None)  # written by this tier itself: adoptable again


def head_split_of(site: TierSite, kv_heads: int) -> HeadSplit:
    """This rank's share of `kv_heads`, its rows measured from the registered caches: in `kv-first` and
    `blocks-first` every layer's block is K then V of `block_tokens` rows; other layouts are `HeadsDoNotSplit`."""
    caches = site.caches
    others = sorted(set(caches.layouts.values()) - HEADED_LAYOUTS)
    if others:
        raise HeadsDoNotSplit(f"layouts {others} have no KV heads to store one value each (kv_heads is for "
                              f"{sorted(HEADED_LAYOUTS)})")
    rows = {plane.block_bytes // (2 * caches.block_tokens) for plane in caches.planes}
    if len(rows) != 1 or any(plane.block_bytes % (2 * caches.block_tokens) for plane in caches.planes):
        raise HeadsDoNotSplit(f"layers whose blocks are not K and V of {caches.block_tokens} equal rows")
    return HeadSplit.of_rank(kv_heads, site.worker, site.offload.num_workers, rows.pop(), site.block_bytes)


def head_layout_of(caches: KVCaches, heads: HeadSplit) -> str:
    """The layout of one head's value, the same at every TP size: layouts per group, each layer's name and piece
    count (their order is the rows' order), the head's width and the model's KV heads."""
    groups = ",".join(f"{group}={layout}" for group, layout in sorted(caches.layouts.items()))
    planes = ",".join(f"{p.name}:{p.pieces}" for p in caches.planes)
    return f"per-head;{groups};{planes};head_bytes={heads.head_bytes};kv_heads={heads.kv_heads}"


def open_mooncake(config: MooncakeTierConfig, site: TierSite, io: IoExecutor | None, keep_lookups: bool,
                  machines: MachineSet) -> MooncakeTier:
    """Connect to the configured master (bounded by the client's connect timeout), register the CPU pool for
    zero-copy calls, and open the tier. A missing, unreadable or short tenant secret is `SecretUnavailable` and a
    master that cannot be reached `StoreUnavailable`, both here, at start-up, where they are best reported."""
    mac = ValueMac(load_value_key(config.secret_file, config.secret_env, config.tenant))
    client = MooncakeClient(ClientSettings(
        master=MasterAddress.parse(config.master), segment_bytes=config.segment_bytes,
        op_timeout_s=config.op_timeout_s, retry_after_s=config.retry_after_s, max_pending=config.max_pending,
        hash_threads=config.hash_threads), mac, io=io)
    client.connect()
    offload = site.offload
    heads = None if config.kv_heads is None else head_split_of(site, config.kv_heads)
    if heads is None:
        namespace = site.namespace(config.model_id, config.kv_dtype)
    else:
        namespace = KvNamespace(model_id=config.model_id, dtype=config.kv_dtype,
                                layout=head_layout_of(site.caches, heads), block_tokens=offload.cpu_block_tokens)
    return MooncakeTier(config.tier_name, client, namespace, site.block_bytes, tenant=config.tenant,
                        lookup_timeout_s=config.lookup_timeout_s, keep_lookups=keep_lookups,
                        pool=site.pool.buffer.numpy(), index_keys=config.index_keys, machines=machines, heads=heads)
