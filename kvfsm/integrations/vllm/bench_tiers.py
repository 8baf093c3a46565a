"""A prefix set larger than the CPU pool, returning later: kvfsm with its disk tier beside vLLM's `OffloadingConnector`
with its `fs` tier, both under vLLM 0.32's real `Scheduler` on the same request stream.

Sixteen prefixes of 32 blocks are each computed once, one after the other (the warm-up: each request and what its
stores started run to the end before the next arrives; vLLM's GPU prefix cache is then reset), through a CPU tier of
64 blocks: the pool ends holding the last two prefixes at most, and each connector writes what it stored below it
(kvfsm: every stored block written back, `eager`, or the pool's next eviction victims, `on-evict`; vLLM: every stored
chunk cascaded to its `fs` tier). Then every prefix returns once, one a step, with one new token. Counted in that
second pass: the prefix tokens each connector loaded, and how many of them came from below DRAM (kvfsm: tokens loaded
from CPU blocks a disk fetch brought; vLLM: tokens of loads its connector attributes to its `fs` tier), loads,
deferrals, steps to first token, and the scheduler thread's CPU µs per step (`schedule()` + `update_from_output()`, as
in `bench.py`).

Each step takes `step_ms` of wall time as a model's forward pass would (`bench.Run`'s `step_s`: a sleep after the
worker's hooks, the same for every run, outside the CPU time measured): both connectors run their tiers' lookups and
I/O on threads, and steps spun back to back would give those threads no time at all, vLLM's lookups the most (each
answers "ask again" until its thread answered).

Where the bytes move: vLLM's `fs` tier reads and writes files on threads of the scheduler process, over a host region
it shares with the workers, so its fake worker (`bench.OffloadingFakeWorker`) only completes GPU<->CPU jobs. kvfsm's
tiers live in the workers: its run drives the adapter's real worker role (`rig.WorkerRole`, on `SimDevice`), whose
disk tier writes and reads a slot file on its own threads. Neither moves the model's real bytes (the fake forward
writes nothing), and the GPU<->CPU copies are simulated; the tiers' file I/O is real in both.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Iterator

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvfsm.integrations.vllm import bench_table
from kvfsm.integrations.vllm.bench import Run, play
from kvfsm.integrations.vllm.bench_workloads import Arrival, Workload, random_tokens
from kvfsm.integrations.vllm.config import gpu_block_bytes
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, WorkerRole, kv_cache_config, model_config

CPU_TIER_BLOCKS = 64
BLOCK_BYTES = gpu_block_bytes(kv_cache_config(1))
RUNS = ("vllm fs", "kvfsm disk eager", "kvfsm disk on-evict")
STEP_MS = 5.0
"""A model step's wall time by default: a few milliseconds, a small model's decode step on a GPU."""


def tiered_prefixes(prefixes: int = 16, prefix_blocks: int = 32, per_step: int = 1,
                    tail_steps: int = 160) -> Workload:
    """`prefixes` prompts of `prefix_blocks` blocks computed in the warm-up, then each returning once with one more
    token, `per_step` a step; `tail_steps` more steps let the last fetches land and their requests finish."""
    docs = [random_tokens(40_000 + d, prefix_blocks * BLOCK_SIZE) for d in range(prefixes)]
    warm = [Arrival(f"w{d}", doc + [1], max_tokens=1) for d, doc in enumerate(docs)]
    steps = -(-prefixes // per_step)
    stream = [[Arrival(f"r{d}", docs[d] + [2], max_tokens=1)
               for d in range(step * per_step, min(prefixes, (step + 1) * per_step))] for step in range(steps)]
    gpu_blocks = 4 * per_step * (prefix_blocks + 2)
    return Workload("tiered-prefixes", gpu_blocks, steps + tail_steps,
                    lambda step: stream[step] if step < steps else [], warm=warm,
                    warm_one_by_one=True)


QUICK = {"prefixes": 6, "prefix_blocks": 16, "tail_steps": 80}
"""Small sizes: check the plumbing in seconds, not the figures (the CPU tier still holds fewer than all prefixes)."""


def _options(run: str, folder: Path) -> tuple[str, dict[str, Any]]:
    """The connector and `play`'s options for one row: its extra config (and kvfsm's real worker role)."""
    if run == "vllm fs":
        return "vllm", {"extra": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_TIER_BLOCKS * BLOCK_BYTES,
            "secondary_tiers": [{"type": "fs", "root_dir": str(folder / "vllm-fs"), "n_read_threads": 2,
                                 "n_write_threads": 2}]}}
    writeback = run.rsplit(" ", 1)[1]
    disk = {"kind": "disk", "path": str(folder / "kvfsm-disk"), "writeback": writeback,
            "capacity_bytes": 64 * CPU_TIER_BLOCKS * BLOCK_BYTES}
    return "kvfsm", {"extra": {"cpu_blocks": CPU_TIER_BLOCKS, "lower_tiers": [disk]}, "worker": WorkerRole}


def _tokens_from_below(bench: Run) -> int:
    """Prefix tokens loaded from CPU blocks a lower tier brought (vLLM: tokens of loads its connector says came from
    its `fs` tier)."""
    side = getattr(bench.scheduler.connector, "scheduler_side", None)
    if side is not None:
        return sum(side.kvfsm.tiers.stats.tokens_loaded_from.values())
    return bench.from_disk  # type: ignore[attr-defined]


def _count_disk_loads(bench: Run) -> None:
    """Count the tokens of each load vLLM's connector accepted that it attributes to its `fs` tier: its own split of
    an accepted hit by source (`get_external_cache_hit_sources`, which vLLM's Scheduler asks only when it logs
    stats), asked as the load is planned."""
    connector = bench.scheduler.connector
    assert connector is not None
    bench.from_disk = 0  # type: ignore[attr-defined]
    allocated = connector.update_state_after_alloc

    def counted(request: Any, blocks: Any, num_external_tokens: int) -> None:
        allocated(request, blocks, num_external_tokens)
        if num_external_tokens:
            sources = connector.get_external_cache_hit_sources(request, num_external_tokens)
            bench.from_disk += sources.get(CacheHitSource.DISK, 0)  # type: ignore[attr-defined]

    connector.update_state_after_alloc = counted  # type: ignore[method-assign]


def compare_tiers(quick: bool = False, step_ms: float = STEP_MS) -> Iterator[dict[str, Any]]:
    """One row per run of the same stream, each step taking `step_ms` of wall time; the second pass's prompt tokens
    and what served them."""
    with tempfile.TemporaryDirectory() as folder:
        model = model_config(Path(folder) / "tiny-llama")
        workload = tiered_prefixes(**(QUICK if quick else {}))
        for name in RUNS:
            connector, options = _options(name, Path(folder) / name.replace(" ", "-"))
            hooks = _count_disk_loads if connector == "vllm" else None
            bench, measured = play(workload, connector, model, hooks=hooks, step_s=step_ms / 1000, **options)
            figures = bench.figures(measured)
            below = _tokens_from_below(bench)
            if bench.worker is not None and hasattr(bench.worker, "close"):
                bench.worker.close()
            yield {"workload": workload.name, "run": name, "step_ms": step_ms, "requests": len(measured),
                   "prompt_tokens": sum(len(a.prompt) for s in range(workload.steps) for a in workload.arrivals(s)),
                   "tokens_loaded": figures["blocks_loaded"] * BLOCK_SIZE, "tokens_from_below": below,
                   "loads": figures["loads"], "deferrals": figures["deferrals"],
                   "ttft_steps_mean": figures["ttft_steps_mean"], "first_tokens": figures["first_tokens"],
                   "us_per_step": statistics.fmean(bench.step_us),
                   "us_per_step_median": statistics.median(bench.step_us)}


COLUMNS = {
    "workload": "workload", "run": "connector + tier", "requests": "returning", "prompt_tokens": "prompt tokens",
    "tokens_loaded": "tokens loaded", "tokens_from_below": "from below DRAM", "loads": "loads",
    "deferrals": "deferrals", "ttft_steps_mean": "steps to 1st token", "first_tokens": "answered",
    "us_per_step": "CPU µs/step", "us_per_step_median": "median",
}


def main(out: Path = Path("bench-out"), quick: bool = False, step_ms: float = STEP_MS) -> list[dict[str, Any]]:
    """Run, print the table, and write `vllm-tiers.json` and `vllm-tiers.md` under `out`."""
    title = (f"vLLM 0.32 Scheduler, a prefix set larger than the CPU tier, returning, a {step_ms:g} ms model step: "
             "who serves it")
    return bench_table.publish(list(compare_tiers(quick, step_ms)), COLUMNS, title, ("workload", "connector + tier"),
                               out, "vllm-tiers", quick)
