"""Conversions between vLLM's types and kvfsm's, and nothing else.

vLLM names a block by a `BlockHash` (bytes, a chain over the prefix); kvfsm's catalogue keys on ints. The hash is
read as one big-endian integer at full width, so the conversion is lossless and back-conversion for KV-cache events
gives vLLM's own bytes. vLLM pages every KV-cache group separately; kvfsm's scheduler tracks each group of a request
as a request of its own (`groups`), so the block tables are followed per group.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput

from kvfsm.connector.metadata import ConnectorMetadata, SchedulerOutput, WorkerOutput
from kvfsm.integrations.vllm.groups import Group
from kvfsm.integrations.vllm.master_lookup import KeyScheme

if TYPE_CHECKING:
    from vllm.v1.request import Request

ONE_GROUP = (Group(index=0, rank=0, window=None),)
"""A configuration of one full-attention group (the hybrid allocator off)."""


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
    """A vLLM `Request` as kvfsm's `RequestView`; hashes are converted once each, as vLLM appends them (the adapter
    keeps one view per request across its lookups, `SchedulerSide._views_of`)."""

    def __init__(self, request: "Request", codec: HashCodec) -> None:
        self._request = request
        self._codec = codec
        self._hashes: list[int] = []

    def wraps(self, request: "Request") -> bool:
        """Whether this is the view of `request` (the same object: vLLM appends to a request's hashes, never rewrites)."""
        return self._request is request

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens

    @property
    def in_flight_tokens(self) -> int:
        """Tokens vLLM scheduled whose step's output it has not processed yet (async scheduling keeps one step in
        flight); read before vLLM counts the step being scheduled."""
        return self._request.num_in_flight_tokens

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
    """Each scheduled request's block ids in every offloaded group, kept from the block ids vLLM's scheduler output
    carries, under the id kvfsm tracks the group of the request by (`Group.request_id`).

    vLLM sends a new request's blocks, then only the blocks each step added, and all blocks again when a preempted
    request resumes; following those (as vLLM's own connector does) costs per step only what changed, where
    resolving every request's table from vLLM's KV-cache manager costs its whole length, every step. A table is a
    tuple, replaced when blocks are added: the step hands it to kvfsm as it is, without a copy per request."""

    def __init__(self, groups: Sequence[Group] = ONE_GROUP) -> None:
        self.groups = tuple(groups)
        self._tables: dict[str, tuple[int, ...]] = {}

    def update(self, output: VllmSchedulerOutput) -> None:
        tables = self._tables
        for group in self.groups:
            index, tracked = group.index, group.request_id
            for req_id in output.finished_req_ids:
                tables.pop(tracked(req_id), None)
            for req_id in output.preempted_req_ids or ():
                tables.pop(tracked(req_id), None)
            for req_data in output.scheduled_new_reqs:
                tables[tracked(req_data.req_id)] = tuple(req_data.block_ids[index])
            cached = output.scheduled_cached_reqs
            resumed = cached.resumed_req_ids
            changed = zip(cached.req_ids, cached.new_block_ids)
            if not resumed:  # only the requests that got blocks this step (vLLM sends None for the others)
                changed = compress(changed, cached.new_block_ids)
            for req_id, new_blocks in changed:
                new = tuple(new_blocks[index]) if new_blocks else ()
                key = tracked(req_id)
                table = tables.get(key)
                tables[key] = new if table is None or req_id in resumed else table + new

    def __getitem__(self, tracked_id: str) -> tuple[int, ...]:
        return self._tables[tracked_id]

    def left_behind(self, tracked_id: str, first_kept: int, null_block: int) -> tuple[int, ...]:
        """The blocks before `first_kept` that vLLM has put its null block in place of since the table was last
        read (its sliding window left them behind); the table names the null block there from now on."""
        table = self._tables[tracked_id]
        left = tuple(b for b in table[:first_kept] if b != null_block)
        if left:
            self._tables[tracked_id] = (null_block,) * first_kept + table[first_kept:]
        return left

    def of(self, req_ids: Sequence[str]) -> Iterator[tuple[int, ...]]:
        """The tables of `req_ids`, in order (a lookup in C per request)."""
        return map(self._tables.__getitem__, req_ids)


def scheduler_output(output: VllmSchedulerOutput, tables: BlockTables, before: dict[str, int]) -> SchedulerOutput:
    """The requests computed this step (each group's blocks, computed tokens after the step) and the preempted ones,
    from tables already updated with this step (`BlockTables.update`) and each request's computed tokens before it
    (`computed_before` of the same output, which the caller also needs).

    Built from vLLM's own typed scheduler output: constructed without re-validating, column by column at C speed
    (no object per request: building a record per running request per step was the adapter's largest cost).

    A request both preempted and finished in the output (vLLM's `reset_prefix_cache(reset_running_requests=True)`
    preempts it, then it is aborted before the next step) is not passed on as preempted: kvfsm heard of its end first
    (`request_finished`), which gave its GPU blocks back fenced where stores still read them (lazy-fence), so there is
    nothing of it left to preempt."""
    req_ids = tuple(output.num_scheduled_tokens)
    computed = tuple(map(operator.add, map(before.__getitem__, req_ids), output.num_scheduled_tokens.values()))
    preempted = sorted(set(output.preempted_req_ids or ()).difference(output.finished_req_ids))
    if len(tables.groups) > 1:
        groups = tables.groups
        req_ids = tuple(g.request_id(r) for g in groups for r in req_ids)
        computed = computed * len(groups)
        preempted = sorted(g.request_id(r) for g in groups for r in preempted)
    return SchedulerOutput.model_construct(req_ids=req_ids, block_ids=tuple(tables.of(req_ids)),
                                           num_computed_tokens=computed, preempted=tuple(preempted))


def group_block_ids(blocks: Any, group: Group) -> list[int]:
    """One group's block ids of a `KVCacheBlocks`."""
    return list(blocks.get_block_ids()[group.index])
