"""vLLM's real `Scheduler` on a CPU, driven step by step, with every check: what the vLLM adapter tests run on.

The rig (`kvfsm.integrations.vllm.rig`: vLLM's configuration, `FakeWorker`) is the bench's too; this harness adds
what only tests need. With tensor parallelism (`FakeRanks`) each rank is a fake worker of its own, and their outputs
reach the scheduler through vLLM's own `KVOutputAggregator`, as vLLM's executors deliver them. After every
scheduling and every output the harness checks the rule the adapter exists to keep: no GPU block read or written by
an unfinished, unflushed job has left its request; and `SpecChecks` traces every transition against the spec,
checks kvfsm's named invariants after every step and, once idle, that everything drained. When the configuration
says `async_scheduling` the driver runs vLLM's `AsyncScheduler` as vLLM's engine core does then: step N+1 is
scheduled (and handed to the worker) before step N's output is processed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvfsm.connector.metadata import ConnectorMetadata
from kvfsm.integrations.vllm.checks import SpecChecks
from kvfsm.integrations.vllm.connector import KvfsmConnector
from kvfsm.integrations.vllm.convert import computed_before
from kvfsm.integrations.vllm.rig import (
    BLOCK_SIZE,
    FakeJob,
    FakeWorker,
    StepOutputs,
    WorkerRole,
    kv_cache_config,
    model_output,
    sampled_requests,
)


class HeldBlockReleased(AssertionError):
    """vLLM freed a GPU block that an unfinished, unflushed kvfsm job still reads or writes."""


class ReusedUnderStore(HeldBlockReleased):
    """vLLM handed out again (to a request it schedules, or for a load) a block that an ended request's store, or a
    store of a block its request's sliding window left behind, unflushed, still reads: the step writes it under the
    store (`lazy-fence`, `window-fence`)."""


class ComputedWhileLoading(AssertionError):
    """vLLM scheduled compute for a request while a rank was still loading its blocks."""


class FakeRanks:
    """Tensor-parallel ranks, each a `FakeWorker`; their outputs are combined by vLLM's `KVOutputAggregator`, as
    vLLM's executors combine every worker's output before the scheduler sees it."""

    def __init__(self, workers: list[FakeWorker]) -> None:
        self.workers = workers
        self._aggregator = KVOutputAggregator(expected_finished_count=len(workers))

    def step(self, step: int, output: SchedulerOutput, scheduler: Scheduler) -> KVConnectorOutput:
        # One object per worker, as each arrives from its own process (vLLM's empty-output helper hands out a shared
        # instance, which the aggregator writes into).
        outputs = [ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                     kv_connector_output=w.step(step, output, scheduler)) for w in self.workers]
        aggregated = self._aggregator.aggregate(outputs)  # type: ignore[arg-type]
        assert aggregated is not None and aggregated.kv_connector_output is not None
        return aggregated.kv_connector_output

    def in_flight(self, flushed: tuple[int, ...] = ()) -> list[FakeJob]:
        return [job for w in self.workers for job in w.in_flight(flushed)]

    @property
    def pending_jobs(self) -> bool:
        return any(w.pending_jobs for w in self.workers)


@dataclass
class StepLog:
    step: int
    orders: ConnectorMetadata
    first_computed: dict[str, int]
    """Requests scheduled this step for the first time since admission, with their computed tokens before it."""
    computed: dict[str, int]
    """Every request scheduled this step, with its computed tokens before it."""


class AdapterWorker(WorkerRole):
    """The adapter's real worker role on `SimDevice` tensors shaped as vLLM allocates them (K and V planes first).

    Its forward pass writes, at every computed position, the token id there (mod 251) into every K and V entry, so
    the bytes of a loaded block show whether they came from the right prefix."""

    def forward(self, output: SchedulerOutput, scheduler: Scheduler) -> None:
        """Layer by layer, as vLLM's attention layers run: wait for the layer's load, write it, save it. A position
        whose token is not sampled yet (async scheduling) is written as 0."""
        before = computed_before(output)
        for name, cache in self.caches.items():
            self.connector.wait_for_layer_load(name)
            for req_id, count in output.num_scheduled_tokens.items():
                blocks = scheduler.kv_cache_manager.get_block_ids(req_id)[0]
                tokens = scheduler.requests[req_id].all_token_ids
                for position in range(before[req_id], before[req_id] + count):
                    token = tokens[position] if position < len(tokens) else 0
                    cache[:, blocks[position // BLOCK_SIZE], position % BLOCK_SIZE] = float(token % 251)
            self.connector.save_kv_layer(name, cache, None)  # type: ignore[arg-type]

    def block_tokens(self, block_id: int) -> list[int]:
        """The token ids a block's bytes say it holds (read from the first layer's K plane)."""
        first = next(iter(self.caches.values()))
        return [int(v) for v in first[0, block_id, :, 0, 0]]

    def in_flight(self, flushed: tuple[int, ...] = ()) -> list[FakeJob]:
        return []

    @property
    def pending_jobs(self) -> bool:
        return bool(self.connector.worker_side.kvfsm.jobs)


class Driver:
    """One vLLM scheduler with the kvfsm adapter, stepped by hand against a `FakeWorker` or an `AdapterWorker`."""

    def __init__(self, config: VllmConfig, worker: "FakeWorker | FakeRanks | AdapterWorker",
                 cache: KVCacheConfig | None = None) -> None:
        init_none_hash(sha256)
        self.blocks = config.cache_config.num_gpu_blocks
        self.scheduler: Scheduler = config.scheduler_config.get_scheduler_cls()(
            config, cache or kv_cache_config(self.blocks), StructuredOutputManager(config), block_size=BLOCK_SIZE,
            log_stats=True)
        self.outputs = StepOutputs(self._process, bool(config.scheduler_config.async_scheduling))
        self.connector_stats: list[dict[str, Any]] = []
        """The connector-stats payloads vLLM's scheduler put in its stats, step by step (what its loggers get)."""
        self.worker = worker
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.step_no = 0
        self.first_token: dict[str, int] = {}
        self.arrived: dict[str, int] = {}
        """The step after which each request was added: it can be scheduled from the next step on."""
        self.log: list[StepLog] = []
        self.owners: dict[str, tuple[str, int]] = {}
        """Each tracked id's vLLM request and KV-cache group (`owner`)."""
        kvfsm = self.connector.scheduler_side.kvfsm
        self.checks = SpecChecks(kvfsm, kvfsm.machines, self.connector.scheduler_side.tier_index.tiers)

    @property
    def connector(self) -> KvfsmConnector:
        assert isinstance(self.scheduler.connector, KvfsmConnector)
        return self.scheduler.connector

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2, cache_salt: str | None = None,
            prompt_logprobs: int | None = None) -> None:
        """`cache_salt` is the tenant's, as a vLLM API request carries it: vLLM mixes it into the block hashes.
        `prompt_logprobs`: the request asks for its prompt's logprobs, so vLLM reads no prefix cache for it (its own
        nor the connector's: `skip_reading_prefix_cache`)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
        request = Request(req_id, prompt, params, None, cache_salt=cache_salt, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        self.arrived[req_id] = self.step_no
        self.owners.update((g.request_id(req_id), (req_id, g.index)) for g in self.connector.scheduler_side.groups)

    def steps_to_first_token(self, req_id: str) -> int:
        """Steps from a request's arrival to the step that sampled its first token (1: the first step it could)."""
        return self.first_token[req_id] - self.arrived[req_id]

    def step(self) -> StepLog:
        self.step_no += 1
        output = self.scheduler.schedule()
        orders = output.kv_connector_metadata.orders
        self.check_held(orders.flush)
        self.check_reuse(output)
        self.check_block_tables(output)
        self.check_not_loading(output)
        first = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        first.update((r, n) for r, n in zip(cached.req_ids, cached.num_computed_tokens) if r in cached.resumed_req_ids)
        result = model_output(self.scheduler, output, self.worker.step(self.step_no, output, self.scheduler))
        log = StepLog(self.step_no, orders, first, computed_before(output))
        self.log.append(log)
        self.outputs.ran(self.step_no, output, result)
        return log

    def _process(self, step: int, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        outputs = self.scheduler.update_from_output(output, result)
        for req_id in sampled_requests(outputs):
            self.first_token.setdefault(req_id, step)
        self.connector_stats += [engine.scheduler_stats.kv_connector_stats for engine in outputs.values()
                                 if engine.scheduler_stats and engine.scheduler_stats.kv_connector_stats]
        self.check_held()
        self.checks.after_step(step)

    def run(self, max_steps: int = 50, after_step: Callable[[], object] = lambda: None) -> None:
        """Step until the scheduler has nothing left (finished requests' held blocks included), then require the
        adapter drained; `after_step` runs after each step (a test's own sampling)."""
        while self.scheduler.has_requests() or self.worker.pending_jobs or self.outputs.pending:
            if self.step_no >= max_steps:
                raise AssertionError(f"not idle after {max_steps} steps")
            if self.scheduler.has_requests() or self.worker.pending_jobs:
                self.step()
            else:
                self.outputs.flush()
            after_step()
        self.checks.after_idle(self.step_no)

    def close(self) -> None:
        """Stop tracing: the machines are shared by every driver of the process."""
        self.checks.close()

    def owner(self, tracked_id: str) -> tuple[str, int]:
        """The vLLM request and KV-cache group a job's request id names (`Group.request_id`), as recorded when the
        request was added: a request id may hold `@g` itself."""
        return self.owners[tracked_id]

    def held(self, tracked_id: str) -> set[int]:
        """The blocks vLLM holds for the job's request in the job's group (none once the request ended)."""
        req_id, group = self.owner(tracked_id)
        if req_id not in self.scheduler.requests:
            return set()
        return set(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def check_held(self, flushed: tuple[int, ...] = ()) -> None:
        """A job of a request vLLM still has keeps its blocks; a load's request is never freed under it. A store of
        an ended request, or of blocks its sliding window left behind, may read blocks vLLM took back (`check_reuse`
        sees they are not written under it)."""
        tracked = self.connector.scheduler_side.kvfsm.requests
        for job in self.worker.in_flight(flushed):
            if self.owner(job.req_id)[0] not in self.scheduler.requests and job.kind == "store":
                continue
            slid = tracked[job.req_id].slid if job.kind == "store" and job.req_id in tracked else set()
            owned = self.held(job.req_id) | slid
            lost = [b for b in job.gpu_blocks if b not in owned]
            if lost:
                raise HeldBlockReleased(f"step {self.step_no}: {job.kind} job {job.job_id} of {job.req_id} "
                                        f"still uses GPU blocks {lost}, which vLLM took back")

    def check_reuse(self, output: SchedulerOutput) -> None:
        """lazy-fence, read from vLLM's own tables as the step goes to the workers: no block this step may write (a
        scheduled request's, or one its loads write) is read by an ended request's store the step does not flush."""
        orders = output.kv_connector_metadata.orders
        manager = self.scheduler.kv_cache_manager
        written = {b for req_id in output.num_scheduled_tokens for group in manager.get_block_ids(req_id)
                   for b in group}
        written.update(b for load in orders.loads for b in load.gpu_blocks)
        for job in self.worker.in_flight(orders.flush):
            if job.kind != "store":
                continue
            ended = self.owner(job.req_id)[0] not in self.scheduler.requests
            reused = sorted(written.intersection(set(job.gpu_blocks) - self.held(job.req_id)))
            if reused:
                whose = "ended request" if ended else "running request (its window left them)"
                raise ReusedUnderStore(f"step {self.step_no}: store job {job.job_id} of {whose} {job.req_id} "
                                       f"still reads GPU blocks {reused}, which this step writes unflushed")

    def check_block_tables(self, output: SchedulerOutput) -> None:
        """The block ids the adapter followed from vLLM's outputs are the ones vLLM's KV-cache manager holds."""
        tables = self.connector.scheduler_side.block_tables
        for req_id in output.num_scheduled_tokens:
            for group in tables.groups:
                held = list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group.index])
                ours = list(tables[group.request_id(req_id)])
                if ours != held:
                    raise AssertionError(f"step {self.step_no}: the adapter has {req_id}'s blocks as {ours}, "
                                         f"vLLM holds {held} (group {group.index})")

    def check_not_loading(self, output: SchedulerOutput) -> None:
        """No request is computed while any rank still loads its blocks (checked before the workers see the step).
        With `layer_loads` a load is computed on by design, behind each layer's segment: `inline-load-in-step`
        (checked with the spec's invariants) holds those loads to their own step's output instead."""
        if self.connector.scheduler_side.kvfsm.config.layer_loads:
            return
        for job in self.worker.in_flight():
            if job.kind == "load" and self.owner(job.req_id)[0] in output.num_scheduled_tokens:
                raise ComputedWhileLoading(f"step {self.step_no}: {job.req_id} was scheduled while load job "
                                           f"{job.job_id} was still in flight")

    def reset_gpu_prefix_cache(self) -> None:
        if not self.scheduler.reset_prefix_cache():
            raise AssertionError("vLLM refused to reset its prefix cache (blocks still in use)")

    def cpu_pool_drained(self) -> bool:
        """kvfsm's drained rule, seen from the adapter: no job in flight, no request unreleased, every CPU block
        free or ready."""
        kvfsm = self.connector.scheduler_side.kvfsm
        usage = kvfsm.manager.usage()
        return (not any(job.in_flight for job in kvfsm.jobs.values())
                and all(r.state == "released" for r in kvfsm.requests.values())
                and usage["free"] + usage["ready"] == kvfsm.manager.capacity)
