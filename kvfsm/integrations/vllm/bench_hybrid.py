"""A hybrid model through vLLM 0.32's real `Scheduler`, the hybrid allocator on: kvfsm beside vLLM's
`OffloadingConnector`, on the same stream and the same fake worker as `bench`.

The model has one full-attention group and one sliding-window group (window `WINDOW` tokens, 16-token blocks), as
vLLM's allocator pages them. Documents are stored by a first pass and forgotten by vLLM's GPU prefix cache; then
requests return to them (the document and a question). Per connector: GPU blocks moved per group (loaded, stored),
GPU blocks vLLM holds for its requests as each step is scheduled (every group), steps to first token and the CPU
time `schedule()` + `update_from_output()` take per step. Run with `python -m kvfsm.bench vllm`.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

from kvfsm.integrations.vllm import bench_table
from kvfsm.integrations.vllm.bench import Run, play
from kvfsm.integrations.vllm.bench_workloads import Arrival, Workload, random_tokens
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, NUM_LAYERS, model_config

WINDOW = 128
"""Tokens of the sliding window: eight blocks of the sliding group are a hit's condition and all it reloads."""
GROUPS = ("full", "sliding")


def hybrid_cache(num_blocks: int) -> KVCacheConfig:
    """Half the layers full attention, half a sliding window, each half one group."""
    shape = dict(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
    half = NUM_LAYERS // 2
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(half)], FullAttentionSpec(**shape)),
              KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(half, NUM_LAYERS)],
                               SlidingWindowSpec(**shape, sliding_window=WINDOW))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def returning_documents(documents: int = 16, doc_tokens: int = 1024, per_step: int = 2, steps: int = 40) -> Workload:
    """Every document stored first; then `per_step` requests a step return to them in turn, each with a question."""
    docs = [random_tokens(i, doc_tokens) for i in range(documents)]

    def arrivals(step: int) -> list[Arrival]:
        return [Arrival(f"q{step}-{i}",
                        docs[(step * per_step + i) % documents] + random_tokens(10_000 + step * 8 + i, 17), 4)
                for i in range(per_step)] if step < steps // 2 else []

    warm = [Arrival(f"doc{i}", doc + [1], 1) for i, doc in enumerate(docs)]
    return Workload("hybrid-returning", gpu_blocks=4 * documents * doc_tokens // BLOCK_SIZE, steps=steps,
                    arrivals=arrivals, warm=warm, cache=hybrid_cache)


def moved_per_group(output: SchedulerOutput) -> dict[str, list[int]]:
    """GPU blocks this step's jobs load and store, per group: [loaded, stored]."""
    moved = {group: [0, 0] for group in GROUPS}
    meta = output.kv_connector_metadata
    if isinstance(meta, OffloadingConnectorMetadata):
        for column, jobs in ((0, meta.load_jobs.values()), (1, meta.store_jobs.values())):
            for job in jobs:
                spec = job.dst_spec if column == 0 else job.src_spec
                for group, size in zip(GROUPS, spec.group_sizes or (len(spec.block_ids),)):
                    moved[group][column] += size
    elif meta is not None:
        for column, orders in ((0, meta.orders.loads), (1, meta.orders.stores)):
            for order in orders:
                moved[GROUPS[1] if "@g" in order.req_id else GROUPS[0]][column] += len(order.gpu_blocks)
    return moved


QUICK = {"documents": 4, "doc_tokens": 256, "steps": 10}
"""Small sizes: check the plumbing in seconds, not the figures."""


def measure(connector: str, model: Any, workload: Workload) -> dict[str, Any]:
    """The workload through one connector (prompt-only admission, vLLM's default), with the figures above."""
    moved = {group: [0, 0] for group in GROUPS}
    held: list[int] = []

    def instrument(run: Run) -> None:
        step = run.step

        def counted(measured: bool) -> None:
            if measured:
                manager = run.scheduler.kv_cache_manager
                held.append(len({b for r in run.scheduler.requests for group in manager.get_block_ids(r)
                                 for b in group if b}))  # vLLM's null block (0) is no memory
            schedule = run.scheduler.schedule

            def recorded() -> SchedulerOutput:
                output = schedule()
                if measured:
                    for group, counts in moved_per_group(output).items():
                        moved[group] = [a + b for a, b in zip(moved[group], counts)]
                return output

            run.scheduler.schedule = recorded  # type: ignore[method-assign]
            try:
                step(measured)
            finally:
                del run.scheduler.schedule

        run.step = counted  # type: ignore[method-assign]

    run, requests = play(workload, connector, model, "prompt-only", hooks=instrument)
    figures = run.figures(requests)
    return {"connector": connector, **{f"{g}_{kind}": moved[g][i] for g in GROUPS
                                       for i, kind in enumerate(("loaded", "stored"))},
            "gpu_blocks_held_mean": statistics.fmean(held) if held else 0.0, "gpu_blocks_held_max": max(held, default=0),
            "ttft_steps_mean": figures["ttft_steps_mean"], "us_per_step": figures["us_per_step"]}


def compare(quick: bool = False) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        model = model_config(Path(folder) / "tiny-llama")
        workload = returning_documents(**(QUICK if quick else {}))
        return [measure(connector, model, workload) for connector in ("vllm", "kvfsm")]


COLUMNS = {"connector": "connector", "full_loaded": "full in", "full_stored": "full out",
           "sliding_loaded": "sliding in", "sliding_stored": "sliding out", "gpu_blocks_held_mean": "GPU blocks held",
           "gpu_blocks_held_max": "held max", "ttft_steps_mean": "steps to 1st token", "us_per_step": "CPU µs/step"}


def main(out: Path = Path("bench-out"), quick: bool = False) -> list[dict[str, Any]]:
    """Run, print the table, and write `vllm-hybrid.json` and `vllm-hybrid.md` under `out`."""
    title = f"vLLM 0.32 hybrid allocator, full + sliding window ({WINDOW} tokens): blocks moved per group"
    return bench_table.publish(compare(quick), COLUMNS, title, ("connector",), out, "vllm-hybrid", quick)
