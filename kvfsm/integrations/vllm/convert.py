"""Conversions between vLLM's types and kvfsm's, and nothing else.

vLLM names a block by a `BlockHash` (bytes, a chain over the prefix); kvfsm's catalogue keys on ints. The hash is
read as one big-endian integer at full width, so the conversion is lossless and back-conversion for KV-cache events
gives vLLM's own bytes. vLLM pages every KV-cache group separately; the adapter offloads group 0 (the only group
when the hybrid allocator is off, which a connector without hybrid support requires).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput

from kvfsm.connector.metadata import ConnectorMetadata, SchedulerOutput, WorkerOutput
from kvfsm.integrations.vllm.master_lookup import KeyScheme

if TYPE_CHECKING:
    from vllm.v1.request import Request

OFFLOADED_GROUP = 0
"""The KV-cache group whose block ids kvfsm stores and loads."""


class HashWidthMismatch(ValueError):
    """Two block hashes of one engine have different widths: they cannot come from one hash function."""


class HashCodec:
    """BlockHash bytes <-> int, lossless; the width is learned from the first hash and then enforced."""

    def __init__(self) -> None:
        self.width: int | None = None

    def to_int(self, block_hash: bytes) -> int:
        if self.width is None:
            self.width = len(block_hash)
        elif len(block_hash) != self.width:
            raise HashWidthMismatch(f"a {len(block_hash)}-byte block hash after {self.width}-byte ones")
        return int.from_bytes(block_hash, "big")

    def to_bytes(self, value: int) -> bytes:
        if self.width is None:
            raise HashWidthMismatch("no block hash was converted yet, so the width is unknown")
        return value.to_bytes(self.width, "big")


class RequestView:
    """A vLLM `Request` as kvfsm's `RequestView`; hashes are converted once each, as vLLM appends them."""

    def __init__(self, request: "Request", codec: HashCodec) -> None:
        self._request = request
        self._codec = codec
        self._hashes: list[int] = []

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens

    @property
    def block_hashes(self) -> Sequence[int]:
        new = self._request.block_hashes[len(self._hashes):]
        self._hashes.extend(self._codec.to_int(h) for h in new)
        return self._hashes


@dataclass
class KvfsmMetadata(KVConnectorMetadata):
    """kvfsm's orders for one step, in the envelope vLLM hands to every worker."""

    orders: ConnectorMetadata
    tier_discards: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(tier, keys) each worker's tier drops before this step's tier orders: the scheduler's index dropped them (a
    cache reset), so the bytes behind them must never be found again (`kvfsm.integrations.vllm.tier_index`)."""


@dataclass
class KvfsmWorkerMetadata(KVConnectorWorkerMetadata):
    """Each worker's job completions for one step; vLLM aggregates them across workers before the scheduler."""

    reports: tuple[WorkerOutput, ...] = field(default_factory=tuple)
    evicted: tuple[tuple[str, int], ...] = ()
    """(tier, key) a worker's tier evicted on its own since its last report (a full disk making room): the
    scheduler's index forgets the key, for every rank, since one rank no longer holds its share."""

    namespaces: tuple[tuple[str, int, KeyScheme], ...] = ()
    """(tier, rank, key scheme) of each shared tier a worker opened, in its first report: the scheduler asks the
    tier's master for keys named as every rank names them (`master_lookup`)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvfsmWorkerMetadata":
        if not isinstance(other, KvfsmWorkerMetadata):
            raise TypeError(f"cannot aggregate kvfsm worker metadata with {type(other).__name__}")
        return KvfsmWorkerMetadata(self.reports + other.reports, self.evicted + other.evicted,
                                   self.namespaces + other.namespaces)


def computed_before(output: VllmSchedulerOutput) -> dict[str, int]:
    """Each scheduled request's computed tokens before this step (vLLM splits them by new and cached requests)."""
    before: dict[str, int] = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    return before


class BlockTables:
    """Each scheduled request's group-0 block ids, kept from the block ids vLLM's scheduler output carries.

    vLLM sends a new request's blocks, then only the blocks each step added, and all blocks again when a preempted
    request resumes; following those (as vLLM's own connector does) costs per step only what changed, where
    resolving every request's table from vLLM's KV-cache manager costs its whole length, every step. A table is a
    tuple, replaced when blocks are added: the step hands it to kvfsm as it is, without a copy per request."""

    def __init__(self) -> None:
        self._tables: dict[str, tuple[int, ...]] = {}

    def update(self, output: VllmSchedulerOutput) -> None:
        tables = self._tables
        for req_id in output.finished_req_ids:
            tables.pop(req_id, None)
        for req_id in output.preempted_req_ids or ():
            tables.pop(req_id, None)
        for req_data in output.scheduled_new_reqs:
            tables[req_data.req_id] = tuple(req_data.block_ids[OFFLOADED_GROUP])
        cached = output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        changed = zip(cached.req_ids, cached.new_block_ids)
        if not resumed:  # only the requests that got blocks this step (vLLM sends None for the others)
            changed = compress(changed, cached.new_block_ids)
        for req_id, new_blocks in changed:
            new = tuple(new_blocks[OFFLOADED_GROUP]) if new_blocks else ()
            table = tables.get(req_id)
            tables[req_id] = new if table is None or req_id in resumed else table + new

    def __getitem__(self, req_id: str) -> tuple[int, ...]:
        return self._tables[req_id]

    def of(self, req_ids: Sequence[str]) -> Iterator[tuple[int, ...]]:
        """The tables of `req_ids`, in order (a lookup in C per request)."""
        return map(self._tables.__getitem__, req_ids)


def scheduler_output(output: VllmSchedulerOutput, tables: BlockTables) -> SchedulerOutput:
    """The requests computed this step (group-0 blocks, computed tokens after the step) and the preempted ones.

    Built from vLLM's own typed scheduler output: constructed without re-validating, column by column at C speed
    (no object per request: building a record per running request per step was the adapter's largest cost)."""
    tables.update(output)
    before = computed_before(output)
    req_ids = tuple(output.num_scheduled_tokens)
    computed = map(operator.add, map(before.__getitem__, req_ids), output.num_scheduled_tokens.values())
    return SchedulerOutput.model_construct(req_ids=req_ids, block_ids=tuple(tables.of(req_ids)),
                                           num_computed_tokens=tuple(computed),
                                           preempted=tuple(sorted(output.preempted_req_ids or ())))


def group_block_ids(blocks: Any) -> list[int]:
    """Group 0's block ids of a `KVCacheBlocks`."""
    return list(blocks.get_block_ids()[OFFLOADED_GROUP])
