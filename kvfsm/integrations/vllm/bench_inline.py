"""Returning prefixes under vLLM 0.32's real `Scheduler`: how many steps a CPU hit waits for its first token.

A prefix that comes back from the CPU pool is computed, with vLLM's `OffloadingConnector` (and kvfsm without
`layer_loads`), only once its asynchronous load was reported: a step after the load went out at best. kvfsm with
`layer_loads` answers the hit as a synchronous load, and vLLM computes it in the step that loads it, each attention
layer waiting for its own segment of the load (`wait_for_layer_load`). This bench runs one stream of returning
prefixes (every measured request a CPU hit: its document was stored in the warm-up and vLLM's GPU prefix cache then
reset) through the three and compares, request by request, the steps from arrival to first token, and the tokens
each request got (equal in every run). It does so twice: with vLLM's scheduling synchronous, and under async
scheduling (vLLM 0.32's default: vLLM's `AsyncScheduler`, step N+1 scheduled before step N's output is processed),
where kvfsm loads every CPU hit asynchronously whatever `layer_loads` says (`no-inline-load-under-async-scheduling`).

Steps, not seconds: the fake worker reports an asynchronous load `LOAD_STEPS` steps after its order (as
`bench.py` does for both connectors), a load the connector computes inline in its own step, which is what the adapter's worker does (it
waits on the host for the step's loads before reporting). On a GPU the load's step is longer by whatever of the
load its compute does not overlap; the per-layer reload's time against its PCIe floor is measured in
docs/benchmarks.md's TTFT section. CPU µs per step is the scheduler's own thread time, as in `bench.py`.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Iterator

from kvfsm.integrations.vllm import bench_table
from kvfsm.integrations.vllm.bench import Run, play
from kvfsm.integrations.vllm.bench_workloads import Arrival, Workload, random_tokens
from kvfsm.integrations.vllm.rig import model_config

RUNS: dict[str, tuple[str, bool]] = {
    "vllm": ("vllm", False), "kvfsm": ("kvfsm", False), "kvfsm layer_loads": ("kvfsm", True),
}
"""Row name: (connector in `bench.CONNECTORS`, `layer_loads`)."""
BASELINE = "vllm"
SCHEDULING = {"sync": False, "async": True}
"""vLLM's scheduling: synchronous (`--no-async-scheduling`), or async (vLLM 0.32's default), where kvfsm loads every
CPU hit asynchronously whatever `layer_loads` says (docs/vllm.md)."""


def returning_prefixes(documents: int = 96, doc_tokens: int = 2048, per_step: int = 4, seed: int = 0) -> Workload:
    """`documents` prompts stored in the warm-up; then `per_step` of them come back each step with a new question,
    each once, so every measured request's prefix is on CPU and nowhere on the GPU."""
    docs = [random_tokens(seed * 100_000 + 20_000 + d, doc_tokens) for d in range(documents)]
    steps = -(-documents // per_step)
    stream = [[Arrival(f"q{d}", docs[d] + random_tokens(30_000 + d, 24), max_tokens=8)
               for d in range(step * per_step, min(documents, (step + 1) * per_step))] for step in range(steps)]
    warm = [Arrival(f"w{d}", doc + [1], max_tokens=1) for d, doc in enumerate(docs)]
    gpu_blocks = 12 * per_step * (doc_tokens // 16 + 4)  # every request of about 12 steps' arrivals at once
    return Workload("returning-prefixes", gpu_blocks, steps + 24, lambda step: stream[step] if step < steps else [],
                    warm=warm, max_batched_tokens=per_step * (doc_tokens + 64))


QUICK = {"documents": 12, "doc_tokens": 256, "per_step": 3}
"""Small sizes: check the plumbing in seconds, not the figures."""


def compare_inline(quick: bool = False) -> Iterator[dict[str, Any]]:
    """One row per run and scheduling: steps to first token of every CPU hit, the fewest steps gained over vLLM's
    connector (same scheduling) by any one request, whether every request got the same tokens as there, and the
    scheduler's CPU µs per step."""
    with tempfile.TemporaryDirectory() as folder:
        model = model_config(Path(folder) / "tiny-llama")
        workload = returning_prefixes(**(QUICK if quick else {}))
        for scheduling, ahead in SCHEDULING.items():
            played = {name: play(workload, connector, model, layer_loads=layer_loads, async_scheduling=ahead)
                      for name, (connector, layer_loads) in RUNS.items()}
            yield from _rows(workload.name, scheduling, played)


def _rows(workload: str, scheduling: str, played: dict[str, tuple[Run, set[str]]]) -> Iterator[dict[str, Any]]:
    base, measured = played[BASELINE]
    base_ttft = {r: base.first_token[r] - base.arrived[r] for r in measured}
    for name, (bench, _) in played.items():
        ttft = {r: bench.first_token[r] - bench.arrived[r] for r in measured}
        gains = [base_ttft[r] - ttft[r] for r in measured]
        yield {"workload": workload, "scheduling": scheduling, "run": name, "requests": len(measured),
               "cpu_hit_blocks": bench.jobs[1], "ttft_steps_mean": statistics.fmean(ttft.values()),
               "ttft_steps_max": max(ttft.values()), "fewest_steps_gained": min(gains),
               "same_tokens": all(bench.tokens.get(r) == base.tokens.get(r) for r in measured),
               "us_per_step": statistics.fmean(bench.step_us), "us_per_step_median": statistics.median(bench.step_us)}


COLUMNS = {
    "workload": "workload", "scheduling": "scheduling", "run": "connector", "requests": "CPU hits", "cpu_hit_blocks": "blocks in",
    "ttft_steps_mean": "steps to 1st token", "ttft_steps_max": "max", "fewest_steps_gained": "gained on vLLM's (min)",
    "same_tokens": "same tokens", "us_per_step": "CPU µs/step", "us_per_step_median": "median",
}


def main(out: Path = Path("bench-out"), quick: bool = False) -> list[dict[str, Any]]:
    """Run, print the table, and write `vllm-inline.json` and `vllm-inline.md` under `out`."""
    title = "vLLM 0.32 Scheduler, returning prefixes: a CPU hit's steps to first token"
    return bench_table.publish(list(compare_inline(quick)), COLUMNS, title, ("workload", "scheduling", "connector"),
                               out, "vllm-inline", quick)
