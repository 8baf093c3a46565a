"""The connector's public boundary: every illegal argument is refused by name before any state changes.

Each public call of the scheduler and worker halves runs one check from here as its first line. A check reads
the connector and never writes it, so a refused call leaves the connector exactly as it was, and the exception
says what was wrong and what would have been legal. Checks cost what the call itself touches (the requests,
block ids and reports it names), never a walk over the whole connector, so they stay on in production.

What a request's lifecycle state allows is read from the spec: a call that would fire a trigger the request's
state has no transition for is refused before the lookup, the allocation or the step does anything else.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress
from typing import Any, Protocol

from kvfsm.config import OffloadConfig
from kvfsm.connector.due import StoreDue
from kvfsm.connector.metadata import ConnectorMetadata, ConnectorOutput, SchedulerOutput
from kvfsm.connector.refusals import (
    AlreadyRegistered,
    BlockIdOutOfRange,
    BlockSizeMismatch,
    ContradictoryStep,
    DuplicateBlockIds,
    MalformedRequest,
    MoreTokensThanOffered,
    NegativeTokenCount,
    NotPositive,
    NotRegistered,
    RequestStateForbids,
    ReusedJobId,
    TokenCountBeyondRequest,
    TooFewBlocks,
    UnalignedTokenCount,
    UnknownJob,
    UnknownRequest,
    UnknownWorker,
    WrongType,
)
from kvfsm.executor.layouts import KVCaches
from kvfsm.manager.policies import policy_class
from kvfsm.states import TierJobState

DEVICE_METHODS = ("tensor_device", "new_event", "record", "wait", "query", "synchronize", "enqueue", "pin_host",
                  "unpin_host")
"""What the halves call on a device (`kvfsm.executor.device.Device`)."""


class SchedulerHalf(Protocol):
    """What the checks read of a `SchedulerConnector` (named here, not imported: that module imports this one)."""

    config: OffloadConfig
    num_gpu_blocks: int | None
    machines: Any
    jobs: Mapping[int, Any]
    tier_jobs: Mapping[int, Any]
    tiers: Any
    requests: Mapping[str, Any]
    tracked: Mapping[str, Any]
    due: StoreDue


class WorkerHalf(Protocol):
    """What the checks read of a `WorkerConnector`."""

    jobs: Mapping[int, Any]
    _caches: KVCaches | None


def _int(call: str, name: str, value: object) -> int:
    """`value` as an int, refusing booleans and anything without `__index__` (a float token count, say)."""
    if type(value) is int:  # the engines' own counts: one comparison (a bool's type is bool)
        return value
    if isinstance(value, bool):
        raise WrongType(f"{call}: {name} must be an int, got the bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise WrongType(f"{call}: {name} must be an int, got {type(value).__name__} {value!r}") from None


def _count(call: str, name: str, value: object) -> int:
    count = _int(call, name, value)
    if count < 0:
        raise NegativeTokenCount(f"{call}: {name} is {count}; a token count is 0 or more")
    return count


def _instance(call: str, name: str, value: object, cls: type) -> None:
    if not isinstance(value, cls):
        raise WrongType(f"{call}: {name} must be a {cls.__name__}, got {type(value).__name__}")


def _in_cache(call: str, ids: Sequence[int], num_blocks: int | None, owner: str) -> None:
    """Each id in `[0, num_blocks)` (0 or more while the cache size is unknown): a min and a max, in C."""
    if ids and (min(ids) < 0 or (num_blocks is not None and max(ids) >= num_blocks)):
        legal = f"[0, {num_blocks})" if num_blocks is not None else "0 or more"
        bad = sorted({b for b in ids if b < 0 or (num_blocks is not None and b >= num_blocks)})
        raise BlockIdOutOfRange(f"{call}: GPU block ids {bad} of {owner} are outside the KV cache; legal ids: {legal}")


def _distinct(call: str, ids: tuple[int, ...], owner: str) -> None:
    if len(set(ids)) != len(ids):
        twice = sorted({b for b in ids if ids.count(b) > 1})
        raise DuplicateBlockIds(f"{call}: {owner} names GPU blocks {twice} more than once; each block once")


def _request(call: str, request: object, block_size: int) -> tuple[str, int]:
    """The request's id and token count, after checking the fields the connector reads of it."""
    try:
        req_id, num_tokens, hashes = request.request_id, request.num_tokens, request.block_hashes  # type: ignore
    except AttributeError as missing:
        raise WrongType(f"{call}: request must have request_id, num_tokens and block_hashes ({missing})") from None
    if not isinstance(req_id, str) or not req_id:
        raise MalformedRequest(f"{call}: request_id must be a non-empty str, got {req_id!r}")
    num_tokens = _int(call, f"request {req_id!r} num_tokens", num_tokens)
    if num_tokens < 0:
        raise MalformedRequest(f"{call}: request {req_id!r} has {num_tokens} tokens; a request has 0 or more")
    if len(hashes) > num_tokens // block_size:
        raise MalformedRequest(
            f"{call}: request {req_id!r} has {len(hashes)} block hashes for {num_tokens} tokens; "
            f"legal: one per full {block_size}-token block, at most {num_tokens // block_size}")
    return req_id, num_tokens


def _tracked(sched: SchedulerHalf, req_id: str) -> Any:
    """The request's record while the connector tracks it (a released one is kept only as history), else None."""
    return sched.tracked.get(req_id)


_SOURCES: dict[tuple[int, str], tuple[Any, frozenset[str]]] = {}
"""(id of a lifecycle, trigger) -> (the lifecycle, kept alive so its id stays its own; the states it leaves)."""


def _sources(lifecycle: Any, trigger: str) -> frozenset[str]:
    """The states the spec gives `trigger` a transition from; read once per lifecycle, then a dict lookup."""
    key = (id(lifecycle), trigger)
    if key not in _SOURCES:
        states = frozenset(s for t in lifecycle.transitions if t.trigger == trigger for s in t.source)
        _SOURCES[key] = (lifecycle, states)
    return _SOURCES[key][1]


def _state_allows(call: str, sched: SchedulerHalf, req_id: str, state: str, trigger: str) -> None:
    """Refuse a call whose trigger the spec gives no transition from the request's state."""
    legal = _sources(sched.machines["request"].lifecycle, trigger)
    if state not in legal:
        raise RequestStateForbids(
            f"{call}: request {req_id!r} is {state}, which has no {trigger!r} transition; "
            f"legal only for a request that is {_one_of(sorted(legal))}")


def _one_of(names: list[str]) -> str:
    """`a`, `a or b`, `a, b or c`: the legal states as a reader says them."""
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


# --- the scheduler half ----------------------------------------------------------------------------------------


def check_lookup(sched: SchedulerHalf, request: object, num_computed_tokens: object) -> None:
    """`get_num_new_matched_tokens`: a well-formed request, 0 <= computed tokens <= its tokens, lookup legal."""
    call = "get_num_new_matched_tokens"
    req_id, num_tokens = _request(call, request, sched.config.gpu_block_size)
    computed = _count(call, "num_computed_tokens", num_computed_tokens)
    if computed > num_tokens:
        raise TokenCountBeyondRequest(
            f"{call}: num_computed_tokens is {computed}, but request {req_id!r} has {num_tokens} tokens; "
            f"legal: 0 to {num_tokens}")
    record = _tracked(sched, req_id)
    if record is not None:
        _state_allows(call, sched, req_id, record.state, "lookup")


def check_alloc(sched: SchedulerHalf, request: object, block_ids: Sequence[object],
                num_external_tokens: object, store_from: int = 0, state_of: str | None = None) -> None:
    """`update_state_after_alloc`: a looked-up request (and the tracked prefix it is the state of), block ids in the
    cache, at most the offered tokens. Below the blocks it loads or stores (`store_from`) a sliding-window or state
    request's table repeats the engine's null block."""
    call = "update_state_after_alloc"
    req_id, _ = _request(call, request, sched.config.gpu_block_size)
    record = _tracked(sched, req_id)
    if record is None:
        raise UnknownRequest(f"{call}: request {req_id!r} was never looked up; call get_num_new_matched_tokens first")
    if state_of is not None and _tracked(sched, state_of) is None:
        raise UnknownRequest(f"{call}: request {req_id!r} is the state of {state_of!r}, which is not tracked")
    _state_allows(call, sched, req_id, record.state, "allocate")
    block_size = sched.config.gpu_block_size
    tokens = _count(call, "num_external_tokens", num_external_tokens)
    if tokens % block_size:
        raise UnalignedTokenCount(
            f"{call}: num_external_tokens is {tokens}; legal: a multiple of gpu_block_size {block_size}")
    first_gpu, offered = record.match  # a matched request's lookup recorded its match in the same call
    if tokens > offered * block_size:
        raise MoreTokensThanOffered(
            f"{call}: request {req_id!r} accepted {tokens} external tokens, but the lookup offered "
            f"{offered * block_size}; legal: 0 to {offered * block_size} in multiples of {block_size}")
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Iterable):
        raise WrongType(f"{call}: block_ids must be a sequence of ints, got {type(block_ids).__name__}")
    ids = tuple(block_ids)
    if not set(map(type, ids)) <= {int}:  # in C; the slow path converts numpy ints and refuses the rest
        ids = tuple(_int(call, f"a block id of request {req_id!r}", b) for b in ids)
    _in_cache(call, ids, sched.num_gpu_blocks, f"request {req_id!r}")
    _distinct(call, ids[min(store_from, first_gpu) if tokens else store_from:], f"request {req_id!r}")
    needed = first_gpu + tokens // block_size if tokens else 0
    if len(ids) < needed:
        raise TooFewBlocks(f"{call}: request {req_id!r} got {len(ids)} GPU blocks; loading {tokens // block_size} "
                           f"blocks after its {needed - tokens // block_size} cached ones needs {needed} or more")


def check_step(sched: SchedulerHalf, output: SchedulerOutput) -> list[tuple[Any, Sequence[int], int]]:
    """`build_connector_meta`: every named request tracked, each named once, preempted ones running,
    computed tokens not negative and block ids inside the cache.

    Returns (record, block ids, computed tokens) of the scheduled requests whose next CPU block is due: the only
    ones the step has to plan for. The batch is read column by column in C (a set of its ids, a minimum of its
    token counts, one comparison per request with its due point); Python touches only the due requests. A batch
    found quiet is remembered (`StoreDue.known_quiet`), so the steps of a steady decode that complete no CPU block
    cost one tuple comparison and one C pass over the token counts, whatever the batch."""
    call = "build_connector_meta"
    _instance(call, "output", output, SchedulerOutput)
    for req_id in output.preempted:
        record = _tracked(sched, req_id)
        if record is None:
            raise UnknownRequest(f"{call}: preempted request {req_id!r} is not tracked by the connector")
        _state_allows(call, sched, req_id, record.state, "preempt")
    if len(set(output.preempted)) != len(output.preempted):
        raise ContradictoryStep(f"{call}: a request is preempted twice in one step; name each once")
    req_ids, block_ids, computed = output.req_ids, output.block_ids, output.num_computed_tokens
    if not len(req_ids) == len(block_ids) == len(computed):  # a validated output cannot, a constructed one can
        raise ContradictoryStep(f"{call}: {len(req_ids)} req_ids, {len(block_ids)} block_ids and {len(computed)} "
                                "num_computed_tokens; legal: one of each per scheduled request")
    if not req_ids:
        return []
    due_points = sched.due
    if not output.preempted and due_points.known_quiet(req_ids, computed):  # a steady decode step ends here
        return []
    named = set(req_ids)
    if len(named) != len(req_ids):
        raise ContradictoryStep(f"{call}: a request is scheduled twice in one step; name each once")
    both = named.intersection(output.preempted)
    if both:
        raise ContradictoryStep(f"{call}: requests {sorted(both)} are both preempted and scheduled; legal: one")
    if min(computed) < 0:
        req_id, tokens = next((r, c) for r, c in zip(req_ids, computed) if c < 0)
        raise NegativeTokenCount(f"{call}: request {req_id!r} has num_computed_tokens {tokens}; legal: 0 or more")
    try:  # the tracked requests are exactly those with a due point
        dues = due_points.of(req_ids)
    except KeyError as ghost:
        raise UnknownRequest(f"{call}: scheduled request {ghost} is not tracked by the connector") from None
    if not any(map(operator.ge, computed, dues)):  # a quiet decode step ends here
        if type(req_ids) is tuple:
            due_points.remember_quiet(req_ids, dues)
        return []
    is_due = list(map(operator.ge, computed, dues))
    tracked, k = sched.tracked, sched.config.block_size_factor
    due = [(tracked[req_ids[i]], block_ids[i], computed[i]) for i in compress(range(len(req_ids)), is_due)]
    for record, blocks, _ in due:  # only then can its blocks enter an order: O(new blocks)
        _in_cache(call, blocks[record.stored_cpu_blocks * k:], sched.num_gpu_blocks, f"request {record.req_id!r}")
    return due


def check_reports(sched: SchedulerHalf, output: ConnectorOutput) -> None:
    """`update_connector_output`: each report from a worker rank that exists, about a job in flight for it,
    once; each tier job's release from a worker that reported it held, once. All are checked before any job
    completes, so a bad report cannot leave half a step applied."""
    call = "update_connector_output"
    _instance(call, "output", output, ConnectorOutput)
    if not output.workers:  # nothing reported (an idle step's output)
        return
    workers = sched.config.num_workers
    seen: set[tuple[int, int]] = set()
    for report in output.workers:
        if not 0 <= report.worker < workers:
            raise UnknownWorker(f"{call}: a report from worker {report.worker}; legal ranks: 0 to {workers - 1}")
        for job_id in (*report.done, *report.failed):
            job = sched.jobs.get(job_id)
            if (job is None or not job.in_flight or (report.worker, job_id) in seen
                    or report.worker in job.reports):
                raise UnknownJob(f"{call}: worker {report.worker} reported job {job_id}, which is not in flight "
                                 "for it; legal: each job in flight, once per worker")
            seen.add((report.worker, job_id))
        if report.tiers and sched.tiers is None:
            raise UnknownJob(f"{call}: worker {report.worker} reported tier jobs, but no lower tier is configured")
    _check_tier_reports(call, sched, output)


def _check_tier_reports(call: str, sched: SchedulerHalf, output: ConnectorOutput) -> None:
    """A tier job's end once per worker while it is submitted; its release once per worker that reported it held
    (in an earlier output or earlier in this one)."""
    ended: dict[tuple[int, int], bool] = {}  # (worker, job) reported in this output -> held
    released: set[tuple[int, int]] = set()
    for report in output.workers:
        worker = report.worker
        for tier in report.tiers:
            job = sched.tier_jobs.get(tier.job_id)
            key = (worker, tier.job_id)
            if tier.release:
                logged = job.reports.get(worker) if job is not None else None
                held = ended.get(key, logged is not None and logged.held)
                if not held or key in released or worker in job.released:  # type: ignore[union-attr]
                    raise UnknownJob(f"{call}: worker {worker} released tier job {tier.job_id}, which it does not "
                                     "hold; legal: a tier job it reported held, released once")
                released.add(key)
            else:
                if job is None or job.state != TierJobState.SUBMITTED or worker in job.reports or key in ended:
                    raise UnknownJob(f"{call}: worker {worker} reported tier job {tier.job_id}, which is not in "
                                     "flight for it; legal: each tier job in flight, once per worker")
                ended[key] = tier.held


def check_finished(sched: SchedulerHalf, request_id: object, aborted: object) -> None:
    """`request_finished`: a str id and a bool; a tracked request must be in a state that may finish or abort."""
    call = "request_finished"
    if not isinstance(request_id, str) or not request_id:
        raise MalformedRequest(f"{call}: request_id must be a non-empty str, got {request_id!r}")
    _instance(call, "aborted", aborted, bool)
    record = _tracked(sched, request_id)
    if record is not None:
        _state_allows(call, sched, request_id, record.state, "abort" if aborted else "finish")


def check_slide(sched: SchedulerHalf, request_id: object, block_ids: Sequence[object]) -> None:
    """`slide`: a tracked request the spec lets slide (a running one), and int block ids inside the KV cache, none
    of them twice."""
    call = "slide"
    if not isinstance(request_id, str) or not request_id:
        raise MalformedRequest(f"{call}: request_id must be a non-empty str, got {request_id!r}")
    record = _tracked(sched, request_id)
    if record is None:
        raise UnknownRequest(f"{call}: request {request_id!r} is not tracked by the connector")
    _state_allows(call, sched, request_id, record.state, "slide")
    ids = tuple(_int(call, f"a block id of request {request_id!r}", b) for b in block_ids)
    _in_cache(call, ids, sched.num_gpu_blocks, f"request {request_id!r}")
    _distinct(call, ids, f"request {request_id!r}")


def check_halves(call: str, config: object, device: object, worker: object = 0) -> None:
    """`Connector(...)` and `WorkerConnector(...)`: an `OffloadConfig` (pydantic validated it), a `Device`, and a
    worker rank that the scheduler will count among `num_workers`; its eviction policy resolves (before a byte is
    pinned: `UnknownEvictionPolicy`, `NotAnEvictionPolicy`)."""
    _instance(call, "config", config, OffloadConfig)
    policy_class(config.eviction)  # type: ignore[attr-defined]
    rank = _int(call, "worker", worker)
    if not 0 <= rank < config.num_workers:  # type: ignore[attr-defined]
        raise UnknownWorker(f"{call}: worker {rank}; legal ranks with num_workers="
                            f"{config.num_workers}: 0 to {config.num_workers - 1}")  # type: ignore[attr-defined]
    missing = [name for name in DEVICE_METHODS if not callable(getattr(device, name, None))]
    if missing:
        raise WrongType(f"{call}: device must implement kvfsm.executor.Device; {type(device).__name__} lacks "
                        f"{missing} (use CudaDevice or SimDevice)")


def check_scheduler(config: object, gpu_block_bytes: object, num_gpu_blocks: object) -> None:
    """`SchedulerConnector(...)`: an `OffloadConfig` whose eviction policy resolves, a positive block size in
    bytes, a positive block count."""
    call = "SchedulerConnector"
    _instance(call, "config", config, OffloadConfig)
    policy_class(config.eviction)  # type: ignore[attr-defined]
    for name, value in (("gpu_block_bytes", gpu_block_bytes), ("num_gpu_blocks", num_gpu_blocks)):
        if value is not None and _int(call, name, value) < 1:
            raise NotPositive(f"{call}: {name} is {value}; legal: 1 or more")
    if gpu_block_bytes is None:
        raise WrongType(f"{call}: gpu_block_bytes is required (the bytes of one GPU block across all layers)")


# --- the worker half -----------------------------------------------------------------------------------------


def check_registration(worker: WorkerHalf, kv_caches: Mapping[str, Any]) -> None:
    """`register_kv_caches` before it pins anything: once per worker, with a mapping of tensors."""
    call = "register_kv_caches"
    if worker._caches is not None:
        raise AlreadyRegistered(f"{call}: this worker's KV caches are registered already; register once")
    _instance(call, "kv_caches", kv_caches, Mapping)


def check_registered_caches(config: OffloadConfig, caches: KVCaches) -> None:
    """The registered caches page as many tokens per block as the config says, else token arithmetic and the
    bytes moved disagree. Runs after the layout is read and before the pool is pinned."""
    if caches.block_tokens != config.gpu_block_size:
        raise BlockSizeMismatch(
            f"register_kv_caches: the KV cache holds {caches.block_tokens} tokens per block, but "
            f"OffloadConfig.gpu_block_size is {config.gpu_block_size}; legal: caches paged as the config says")


def check_metadata(worker: WorkerHalf, meta: ConnectorMetadata) -> None:
    """`bind_connector_metadata`: a `ConnectorMetadata` whose orders come after registration and reuse no job
    id still in flight. The shape of each order is the transfer's to check: one that cannot be copied fails its
    job visibly, and the engine recomputes."""
    call = "bind_connector_metadata"
    _instance(call, "meta", meta, ConnectorMetadata)
    orders = (*meta.loads, *meta.stores)
    if orders and worker._caches is None:
        raise NotRegistered(f"{call}: register_kv_caches must run before transfers are ordered")
    reused = [o.job_id for o in orders if o.job_id in worker.jobs]
    if reused or len({o.job_id for o in orders}) != len(orders):
        raise ReusedJobId(f"{call}: job ids {reused or 'named twice'} are already in flight on this worker; "
                          "legal: a fresh id per order")
