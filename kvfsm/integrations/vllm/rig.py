"""vLLM's real `Scheduler` on a CPU with a worker that only reports: the rig the vLLM bench and tests run on.

It builds vLLM's configuration for a tiny model folder (a Llama config, no weights), and `FakeWorker` stands in for
GPU workers: it reads kvfsm's orders from `scheduler_output.kv_connector_metadata` and completes each job a chosen
number of steps after it was ordered, as a GPU would report it; flushed stores complete in the step that flushes
them (the real worker waits for them before the forward pass). It reports a failed load's GPU blocks as vLLM's
`invalid_block_ids`, as `WorkerSide` does. `WorkerRole` is the adapter's real worker role instead, on `SimDevice`
tensors shaped as vLLM allocates them, called in vLLM's hook order (the lower tiers' I/O needs it: the fake worker
moves no bytes). The test harness (`tests/vllm_harness.py`) adds the checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import vllm.platforms as platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

platforms._current_platform = CpuPlatform()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from kvfsm.connector.metadata import WorkerOutput  # noqa: E402
from kvfsm.integrations.vllm.connector import KvfsmConnector  # noqa: E402
from kvfsm.integrations.vllm.convert import KvfsmWorkerMetadata  # noqa: E402

BLOCK_SIZE = 16
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE = 2, 2, 64
MAX_MODEL_LEN = 4096
SAMPLED_TOKEN = 7

def tiny_model(folder: Path) -> Path:
    """A model folder vLLM accepts without weights or tokenizer: only a Llama config."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,'
        ' "intermediate_size": 512, "num_hidden_layers": %d, "num_attention_heads": 4,'
        ' "num_key_value_heads": %d, "vocab_size": 1000, "max_position_embeddings": %d,'
        ' "torch_dtype": "float16", "rms_norm_eps": 1e-5}' % (NUM_LAYERS, NUM_KV_HEADS, MAX_MODEL_LEN))
    return folder


def model_config(folder: Path) -> ModelConfig:
    return ModelConfig(model=str(tiny_model(folder)), skip_tokenizer_init=True)


KVFSM_CONNECTOR = "KvfsmConnector"


def vllm_config(model: ModelConfig, extra: dict[str, Any], num_gpu_blocks: int,
                connector: str | None = KVFSM_CONNECTOR, max_batched_tokens: int = 512,
                max_seqs: int = 32, tensor_parallel_size: int = 1, prefix_caching: bool = True,
                async_scheduling: bool = False, pipeline_parallel_size: int = 1) -> VllmConfig:
    """vLLM's configuration with `connector` (kvfsm's, one of vLLM's own by name, or None for none); without
    `prefix_caching` vLLM's GPU prefix cache is off (every request looks its whole prefix up in the connector).
    `async_scheduling` is set after vLLM resolved its configuration: vLLM's CPU platform turns it off, where a GPU
    platform leaves it on by default; the scheduler and the connector read it when they are built."""
    transfer = None if connector is None else KVTransferConfig(
        kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra,
        kv_connector_module_path="kvfsm.integrations.vllm" if connector == KVFSM_CONNECTOR else None,
        kv_load_failure_policy="recompute")
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_batched_tokens, max_num_seqs=max_seqs,
                                         max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False),
        kv_transfer_config=transfer, parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                                                   pipeline_parallel_size=pipeline_parallel_size))
    config.cache_config.num_gpu_blocks = num_gpu_blocks
    config.scheduler_config.async_scheduling = async_scheduling
    return config


def kv_cache_config(num_gpu_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    return KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def model_output(scheduler: Scheduler, output: SchedulerOutput,
                 connector_output: KVConnectorOutput | None) -> ModelRunnerOutput:
    """What a model runner returns for `output`: one token for each request whose prompt is now computed."""
    req_ids = list(output.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = [[SAMPLED_TOKEN] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled, kv_connector_output=connector_output)


def sampled_requests(outputs: dict[int, Any]) -> list[str]:
    """Requests that got a new token in `Scheduler.update_from_output`'s result."""
    return [out.request_id for engine in outputs.values() for out in engine.outputs if out.new_token_ids]


class StepOutputs:
    """When a scheduler's step outputs are processed, as vLLM's engine core does it: at once, or under async
    scheduling (`ahead`) step N's only after step N+1 was scheduled and run."""

    def __init__(self, process: Callable[[int, SchedulerOutput, ModelRunnerOutput], None], ahead: bool) -> None:
        self._process = process
        self.ahead = ahead
        self._unprocessed: tuple[int, SchedulerOutput, ModelRunnerOutput] | None = None

    @property
    def pending(self) -> bool:
        """A step ran whose output is not processed yet."""
        return self._unprocessed is not None

    def ran(self, step: int, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Step `step` ran: process its output now, or under async scheduling the previous step's."""
        earlier, self._unprocessed = self._unprocessed, (step, output, result)
        if not self.ahead:
            self.flush()
        elif earlier is not None:
            self._process(*earlier)

    def flush(self) -> None:
        """Process the step run but not processed yet, if any."""
        earlier, self._unprocessed = self._unprocessed, None
        if earlier is not None:
            self._process(*earlier)


@dataclass
class FakeJob:
    job_id: int
    req_id: str
    kind: str
    gpu_blocks: tuple[int, ...]
    due: int
    ok: bool = True


@dataclass
class FakeWorker:
    """Completes kvfsm jobs `load_steps` / `store_steps` steps after their order (a tracked request's loads in
    `load_steps_of` its own); fails loads of `fail_loads`."""

    rank: int = 0
    load_steps: int = 1
    load_steps_of: dict[str, int] = field(default_factory=dict)
    store_steps: int = 1
    fail_loads: set[str] = field(default_factory=set)
    report_invalid_blocks: bool = True
    """False is a control: a failed load is reported as failed but its blocks are not named to vLLM."""
    pending: dict[int, FakeJob] = field(default_factory=dict)
    loads: list[FakeJob] = field(default_factory=list)
    finished: list[FakeJob] = field(default_factory=list)

    def step(self, step: int, output: SchedulerOutput, scheduler: Scheduler) -> KVConnectorOutput:
        orders = output.kv_connector_metadata.orders
        for job_id in orders.flush:
            if job_id in self.pending:
                self.pending[job_id].due = step
        for load in orders.loads:
            steps = self.load_steps_of.get(load.req_id, self.load_steps)
            job = FakeJob(load.job_id, load.req_id, "load", load.gpu_blocks, step + steps - 1,
                       ok=load.req_id not in self.fail_loads)
            self.pending[job.job_id] = job
            self.loads.append(job)
        for store in orders.stores:
            self.pending[store.job_id] = FakeJob(store.job_id, store.req_id, "store", store.gpu_blocks,
                                              step + self.store_steps)
        finished = [j for j in self.pending.values() if j.due <= step]
        for job in finished:
            del self.pending[job.job_id]
        self.finished += finished
        report = WorkerOutput(worker=self.rank, done=tuple(j.job_id for j in finished if j.ok),
                              failed=tuple(j.job_id for j in finished if not j.ok))
        invalid = {b for j in finished if not j.ok and j.kind == "load" for b in j.gpu_blocks}
        return KVConnectorOutput(
            kv_connector_worker_meta=KvfsmWorkerMetadata((report,)) if finished else None,
            invalid_block_ids=invalid if self.report_invalid_blocks else set())

    def in_flight(self, flushed: tuple[int, ...] = ()) -> list[FakeJob]:
        return [j for j in self.pending.values() if j.job_id not in flushed]

    @property
    def pending_jobs(self) -> bool:
        return bool(self.pending)


class WorkerRole:
    """The adapter's real worker role (`KvfsmConnector`, role WORKER) on `SimDevice` tensors shaped as vLLM allocates
    them (K and V planes first), driven in vLLM's hook order each step. Its forward pass writes nothing
    (`forward`: the test harness's writes each position's token)."""

    def __init__(self, config: VllmConfig) -> None:
        blocks = config.cache_config.num_gpu_blocks
        self.connector = KvfsmConnector(config, KVConnectorRole.WORKER, kv_cache_config(blocks))
        self.caches = {name: torch.zeros(2, blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16)
                       for name in kv_cache_config(blocks).kv_cache_groups[0].layer_names}
        self.connector.register_kv_caches(self.caches)

    def step(self, step: int, output: SchedulerOutput, scheduler: Scheduler) -> KVConnectorOutput:
        meta = output.kv_connector_metadata
        self.connector.handle_preemptions(meta)
        self.connector.bind_connector_metadata(meta)
        self.connector.start_load_kv(None)  # type: ignore[arg-type]
        self.forward(output, scheduler)
        self.connector.wait_for_save()
        self.connector.get_finished(set(output.finished_req_ids))
        result = KVConnectorOutput(invalid_block_ids=self.connector.get_block_ids_with_load_errors(),
                                   kv_connector_worker_meta=self.connector.build_connector_worker_meta())
        self.connector.clear_connector_metadata()
        return result

    def forward(self, output: SchedulerOutput, scheduler: Scheduler) -> None:
        """The model's forward pass, between the step's loads and its stores."""

    def close(self) -> None:
        self.connector.shutdown()
