"""kvfsm's connector beside vLLM's own `OffloadingConnector`, through vLLM 0.32's real `Scheduler` on the CPU.

One request stream per workload runs through no connector, then through vLLM's `OffloadingConnector` and kvfsm's
`KvfsmConnector` under each admission setting (`ADMISSION`: which completed blocks each stores) — with a fake worker that completes every transfer job a fixed number of steps after it was
ordered (flushed stores at once), the same for both connectors. Per step it times what the connector adds to vLLM's
critical path, `schedule()` + `update_from_output()` (GC on), in CPU time of the scheduler's thread (vLLM's scheduler
is one Python thread: on a core of its own that is its wall time, and on a shared machine other processes do not
inflate it), and counts load and store jobs, blocks moved,
deferrals (lookups answered "ask again"), the steps from each request's arrival to its first token and the GPU
blocks vLLM keeps for ended requests as each step is scheduled (`held blocks`: mean and max over the measured
steps) and the stores flushed (each one waited for before a forward pass). Both pools
hold 65536 blocks. The admission settings match each connector's to the other's: `every-block` (vLLM told
`offload_prompt_only: false`, kvfsm's default), `prompt-only` (vLLM's default, kvfsm's `admission="prompt-only"`) and
`threshold-2` (both prompt-only, a block stored at its second offer: vLLM's and kvfsm's `store_threshold: 2`).

Workloads: `steady-decode` (256 running requests of 2k-token prompts, the decode steps after every prefill ended),
`zipf-prefixes` (arrivals whose prompt heads come from a Zipf-popular set of documents already on CPU, with a GPU
too small to keep them all), `preemption-burst` (long decodes on a GPU that runs out, with stores in flight),
`abort-storm` (waves of arrivals, each request aborted mid-decode), `abort-storm-early` (the same, each aborted two
steps after it arrived, its prompt's stores in flight) and `preemption-burst-tail` (the burst, each request finishing
with its last block's store in flight).

Run `python -m kvfsm.bench vllm` (or `python -m kvfsm.integrations.vllm.bench`) in a venv with vLLM 0.32.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from rich.console import Console
from rich.table import Table
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvfsm.integrations.vllm.bench_workloads import QUICK_SIZES, WORKLOADS, Arrival, Workload
from kvfsm.integrations.vllm.config import gpu_block_bytes
from kvfsm.integrations.vllm.rig import (
    BLOCK_SIZE,
    KVFSM_CONNECTOR,
    FakeWorker,
    StepOutputs,
    kv_cache_config,
    model_config,
    model_output,
    sampled_requests,
    vllm_config,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

CONNECTORS: dict[str, str | None] = {"none": None, "vllm": "OffloadingConnector", "kvfsm": KVFSM_CONNECTOR}
ADMISSION: dict[str, dict[str, dict[str, Any]]] = {
    "every-block": {"vllm": {"offload_prompt_only": False}, "kvfsm": {}},
    "prompt-only": {"vllm": {}, "kvfsm": {"admission": "prompt-only"}},
    "threshold-2": {"vllm": {"store_threshold": 2}, "kvfsm": {"admission": "prompt-only", "store_threshold": 2}},
}
"""Per admission setting, what each connector's `kv_connector_extra_config` adds to be told it (vLLM's connector
stores prompt blocks only unless told `offload_prompt_only: false`)."""
LOAD_STEPS, STORE_STEPS = 2, 2
CPU_BLOCKS = 65536


class OffloadingFakeWorker:
    """Completes `OffloadingConnector`'s jobs as its worker reports them: loads name their request in
    `finished_recving`, every job id goes back in `OffloadingWorkerMetadata`."""

    def __init__(self) -> None:
        self.due: dict[int, int] = {}
        self.loads: dict[int, str] = {}

    def step(self, step: int, output: SchedulerOutput, scheduler: Scheduler) -> KVConnectorOutput:
        meta = output.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        for job_id in meta.jobs_to_flush or ():
            self.due[job_id] = step
        for job_id, job in meta.load_jobs.items():
            self.due[job_id] = step + LOAD_STEPS - 1
            self.loads[job_id] = job.req_id
        for job_id in meta.store_jobs:
            self.due.setdefault(job_id, step + STORE_STEPS)
        done = [job for job, due in self.due.items() if due <= step]
        for job_id in done:
            del self.due[job_id]
        recving = {self.loads.pop(job) for job in done if job in self.loads}
        worker_meta = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(done, 1)) if done else None
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=worker_meta)


def job_counts(output: SchedulerOutput) -> tuple[int, int, int, int]:
    """Load jobs, GPU blocks they write, store jobs, GPU blocks they read: ordered in this step."""
    meta = output.kv_connector_metadata
    if isinstance(meta, OffloadingConnectorMetadata):
        loads, stores = meta.load_jobs.values(), meta.store_jobs.values()
        return (len(loads), sum(len(j.dst_spec.block_ids) for j in loads),
                len(stores), sum(len(j.src_spec.block_ids) for j in stores))
    if meta is None:
        return 0, 0, 0, 0
    orders = meta.orders
    return (len(orders.loads), sum(len(o.gpu_blocks) for o in orders.loads),
            len(orders.stores), sum(len(o.gpu_blocks) for o in orders.stores))


class Run:
    """One workload through one vLLM scheduler; everything it measured."""

    def __init__(self, workload: Workload, connector: str, model: Any, admission: str = "every-block",
                 layer_loads: bool = False, async_scheduling: bool = False, extra: Mapping[str, Any] | None = None,
                 worker: Callable[[VllmConfig], Any] | None = None, step_s: float = 0.0) -> None:
        """With `async_scheduling` vLLM's `AsyncScheduler` runs as vLLM's engine core drives it then: step N+1 is
        scheduled before step N's output is processed. `extra`: more of the connector's `kv_connector_extra_config`
        (over the defaults); `worker`: builds the worker that completes the jobs instead of the fake one (the tiered
        bench's real worker role); `step_s`: the model step's wall time, slept after the worker's hooks and before
        the output is processed, so work the connector runs on threads (lookups, file I/O) gets the time a forward
        pass gives it (a sleep: not in the scheduler's CPU time)."""
        init_none_hash(sha256)
        name = CONNECTORS[connector]
        settings = {"cpu_blocks": CPU_BLOCKS, "layer_loads": layer_loads} if name == KVFSM_CONNECTOR else {
            "cpu_bytes_to_use": CPU_BLOCKS * gpu_block_bytes(kv_cache_config(1))}
        extra = settings | ADMISSION[admission].get(connector, {}) | dict(extra or {})
        config = vllm_config(model, extra, workload.gpu_blocks, connector=name, async_scheduling=async_scheduling,
                             max_batched_tokens=workload.max_batched_tokens, max_seqs=workload.max_seqs)
        self.scheduler: Scheduler = config.scheduler_config.get_scheduler_cls()(
            config, workload.cache(workload.gpu_blocks), StructuredOutputManager(config), block_size=BLOCK_SIZE)
        # A load computed in its own step is reported in that step (the adapter's worker waits for it).
        inline = connector == "kvfsm" and self.scheduler.connector.scheduler_side.kvfsm.inline_loads
        self.worker = (worker(config) if worker is not None else None if name is None
                       else OffloadingFakeWorker() if connector == "vllm"
                       else FakeWorker(load_steps=1 if inline else LOAD_STEPS, store_steps=STORE_STEPS))
        self.outputs = StepOutputs(self._process, async_scheduling)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.deferrals = 0
        if self.scheduler.connector is not None:
            self._count_deferrals(self.scheduler.connector)
        self.step_no = 0
        self.arrived: dict[str, int] = {}
        self.first_token: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        """Each request's output tokens, as vLLM emitted them."""
        self.step_us: list[float] = []
        self.jobs = [0, 0, 0, 0]
        self.preemptions = 0
        self.held: list[int] = []
        """GPU blocks vLLM kept for finished or aborted requests as each measured step was scheduled: what the
        connector's `request_finished` made it hold."""
        self.flushed = 0
        """Stores the measured steps flushed: each one a worker waits for before the step's forward pass."""
        self.step_s = step_s

    def _count_deferrals(self, connector: Any) -> None:
        lookup = connector.get_num_new_matched_tokens

        def counted(request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
            answer = lookup(request, num_computed_tokens)
            self.deferrals += answer[0] is None
            return answer

        connector.get_num_new_matched_tokens = counted

    def add(self, arrival: Arrival) -> None:
        self.scheduler.add_request(Request(arrival.req_id, arrival.prompt,
                                           SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True), None,
                                           block_hasher=self.hasher))
        self.arrived[arrival.req_id] = self.step_no

    def abort(self, req_ids: list[str]) -> None:
        live = [r for r in req_ids if r in self.scheduler.requests]
        if live:
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)

    def step(self, measured: bool) -> None:
        self.step_no += 1
        start = time.thread_time()
        output = self.scheduler.schedule()
        scheduled = time.thread_time()
        held = held_blocks(self.scheduler) if measured else 0  # as this step was scheduled: blocks it could not use
        connector_output = None if self.worker is None else self.worker.step(self.step_no, output, self.scheduler)
        if self.step_s:
            time.sleep(self.step_s)
        result = model_output(self.scheduler, output, connector_output)
        updating = time.thread_time()
        self.outputs.ran(self.step_no, output, result)
        end = time.thread_time()
        if measured:
            self.step_us.append((scheduled - start + end - updating) * 1e6)
            self.jobs = [a + b for a, b in zip(self.jobs, job_counts(output))]
            self.preemptions += len(output.preempted_req_ids or ())
            self.held.append(held)
            self.flushed += flushed_stores(output)

    def _process(self, step: int, output: SchedulerOutput, result: Any) -> None:
        outputs = self.scheduler.update_from_output(output, result)
        for req_id in sampled_requests(outputs):
            self.first_token.setdefault(req_id, step)
        for engine in outputs.values():
            for out in engine.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    def figures(self, measured: set[str]) -> dict[str, Any]:
        ttft = [self.first_token[r] - self.arrived[r] for r in measured if r in self.first_token]
        loads, loaded, stores, stored = self.jobs
        return {"steps": len(self.step_us), "us_per_step": statistics.fmean(self.step_us),
                "us_per_step_median": statistics.median(self.step_us), "loads": loads, "blocks_loaded": loaded,
                "stores": stores, "blocks_stored": stored, "deferrals": self.deferrals,
                "preemptions": self.preemptions, "ttft_steps_mean": statistics.fmean(ttft) if ttft else None,
                "ttft_steps_max": max(ttft) if ttft else None, "first_tokens": len(ttft),
                "held_blocks_mean": statistics.fmean(self.held) if self.held else 0.0,
                "held_blocks_max": max(self.held, default=0), "flushed": self.flushed}


def flushed_stores(output: SchedulerOutput) -> int:
    """Store jobs this step's metadata flushes (vLLM's `jobs_to_flush`, kvfsm's `flush`)."""
    meta = output.kv_connector_metadata
    if isinstance(meta, OffloadingConnectorMetadata):
        return len(meta.jobs_to_flush or ())
    return 0 if meta is None else len(meta.orders.flush)


def held_blocks(scheduler: Scheduler) -> int:
    """GPU blocks of requests that ended but whose blocks vLLM has not freed (the connector asked it to keep them)."""
    manager = scheduler.kv_cache_manager
    return sum(len(manager.get_block_ids(req_id)[0]) for req_id, request in scheduler.requests.items()
               if request.is_finished())


def _due_jobs(worker: Any) -> bool:
    return bool(getattr(worker, "due", None) or getattr(worker, "pending", None))


def run(workload: Workload, connector: str, model: Any, admission: str = "every-block") -> dict[str, Any]:
    """The workload through one connector: warm-up requests to the end, then the measured stream."""
    bench, measured = play(workload, connector, model, admission)
    return bench.figures(measured)


def play(workload: Workload, connector: str, model: Any, admission: str = "every-block",
         layer_loads: bool = False, async_scheduling: bool = False, hooks: Callable[[Run], None] | None = None,
         **options: Any) -> tuple[Run, set[str]]:
    """The workload through one connector; the run and the requests it measured. `hooks` instruments the run before
    its first step; `options`: `Run`'s `extra`, `worker` and `step_s`."""
    bench = Run(workload, connector, model, admission, layer_loads, async_scheduling, **options)
    if hooks is not None:
        hooks(bench)
    for batch in [[a] for a in workload.warm] if workload.warm_one_by_one else [workload.warm]:
        for arrival in batch:
            bench.add(arrival)
        while bench.scheduler.has_requests() or _due_jobs(bench.worker):
            bench.step(measured=False)
        bench.outputs.flush()
    bench.scheduler.reset_prefix_cache()
    measured: set[str] = set()
    gc.collect()
    for step in range(workload.steps):
        bench.abort(workload.aborts(step))
        for arrival in workload.arrivals(step):
            bench.add(arrival)
            measured.add(arrival.req_id)
        bench.step(measured=workload.measure_from(bench.scheduler))
    bench.outputs.flush()
    return bench, measured


def compare(names: list[str] | None = None, quick: bool = False,
            admission: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Every workload through no connector, then through vLLM's and kvfsm's under each admission setting; one row
    per workload, setting and connector."""
    with tempfile.TemporaryDirectory() as folder:
        model = model_config(Path(folder) / "tiny-llama")
        for name in names or list(WORKLOADS):
            workload = WORKLOADS[name](**(QUICK_SIZES[name] if quick else {}))
            runs = [("none", "-"), *((c, a) for a in admission or list(ADMISSION) for c in ("vllm", "kvfsm"))]
            baseline: dict[str, Any] = {}
            for connector, setting in runs:
                row = {"workload": name, "connector": connector, "admission": setting,
                       **run(workload, connector, model, "every-block" if setting == "-" else setting)}
                baseline = baseline or row
                row["added_us_per_step"] = row["us_per_step"] - baseline["us_per_step"]
                row["added_us_per_step_median"] = row["us_per_step_median"] - baseline["us_per_step_median"]
                yield row


COLUMNS = {
    "workload": "workload", "connector": "connector", "admission": "admission", "steps": "steps", "us_per_step": "CPU µs/step",
    "added_us_per_step": "added", "us_per_step_median": "median", "added_us_per_step_median": "added (median)",
    "loads": "loads", "blocks_loaded": "blocks in", "stores": "stores", "blocks_stored": "blocks out",
    "deferrals": "deferrals", "preemptions": "preempted", "ttft_steps_mean": "steps to 1st token",
    "ttft_steps_max": "max", "first_tokens": "requests", "held_blocks_mean": "held blocks",
    "held_blocks_max": "held max", "flushed": "flushed",
}


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(title="vLLM 0.32 Scheduler: no connector / OffloadingConnector / KvfsmConnector (fake worker)")
    for title in COLUMNS.values():
        out.add_column(title, justify="left" if title in ("workload", "connector", "admission") else "right")
    for row in rows:
        out.add_row(*(f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k]) for k in COLUMNS))
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table as docs/benchmarks.md shows it."""
    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k])
                                       for k in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(out: Path = Path("bench-out"), quick: bool = False) -> list[dict[str, Any]]:
    """Run, print the table, and write `vllm.json` and `vllm.md` (the table in Markdown) under `out`."""
    rows = list(compare(quick=quick))
    Console(width=200).print(table(rows))
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm.json").write_text(json.dumps({"quick": quick, "load_steps": LOAD_STEPS, "store_steps": STORE_STEPS,
                                               "rows": rows}, indent=2))
    (out / "vllm.md").write_text(markdown(rows))
    return rows


if __name__ == "__main__":
    import typer

    typer.run(main)
