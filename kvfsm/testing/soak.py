"""A long run of the scheduler half with a simulated worker: does its memory stay flat?

Requests arrive, are looked up (hitting the pool often: prompts come from a small Zipf-popular set), load what
hits, run, store what they completed and finish; a share of transfers fail and a share of requests are aborted
mid-flight, so every path that records something (failed jobs, load errors, deferrals, releases) is taken over and
over. It drives only the standalone API (`SchedulerConnector`), and never calls `get_block_ids_with_load_errors`,
as the reference engine does not: whatever the connector keeps must be dropped by the calls an engine does make.

`python -m kvfsm.testing.soak --requests 100000` prints the figure; `tests/test_soak.py` runs a shorter soak.
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from dataclasses import dataclass

import typer

from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import ConnectorOutput, ScheduledRequest, SchedulerOutput, WorkerOutput
from kvfsm.connector.scheduler import SchedulerConnector

BLOCK_TOKENS = 16


@dataclass
class _Request:
    request_id: str
    block_hashes: tuple[int, ...]
    num_tokens: int
    block_ids: tuple[int, ...] = ()
    computed: int = 0
    steps_left: int = 0


@dataclass(frozen=True)
class SoakResult:
    requests: int
    warm_bytes: int
    """Traced memory once `warmup` requests had run (the connector's working set is built by then)."""
    end_bytes: int
    peak_bytes: int

    @property
    def growth_bytes(self) -> int:
        return self.end_bytes - self.warm_bytes


def soak(connector: SchedulerConnector, requests: int, warmup: int, running: int = 16, prompt_blocks: int = 8,
         documents: int = 64, fail_rate: float = 0.05, abort_rate: float = 0.05, seed: int = 0) -> SoakResult:
    """Run `requests` requests through `connector`; memory is traced from before the first one."""
    rng = random.Random(seed)
    popularity = [1.0 / (rank + 1) for rank in range(documents)]
    free_blocks = list(range(running * 2 * (prompt_blocks + 2)))
    live: list[_Request] = []  # running
    loading: dict[str, _Request] = {}
    waiting: list[_Request] = []
    held: dict[str, tuple[int, ...]] = {}  # ended, blocks held by the connector until released
    in_flight: list[int] = []  # jobs ordered or submitted, reported next step
    arrived = 0
    warm = 0
    gc.collect()
    tracemalloc.start()
    try:
        while arrived < requests or live or loading or waiting or held or in_flight:
            while arrived < requests and len(live) + len(loading) + len(waiting) < running:
                doc = rng.choices(range(documents), popularity)[0]
                waiting.append(_Request(f"r{arrived}", tuple(doc << 20 | j for j in range(prompt_blocks)),
                                        prompt_blocks * BLOCK_TOKENS + 1, steps_left=rng.randint(1, 4)))
                arrived += 1
                if arrived == warmup:
                    gc.collect()
                    warm = tracemalloc.get_traced_memory()[0]
            still = []
            for request in waiting:
                match = connector.get_num_new_matched_tokens(request, 0)
                if match is None or len(free_blocks) < prompt_blocks + 1:
                    still.append(request)
                    continue
                request.block_ids = tuple(free_blocks.pop() for _ in range(prompt_blocks + 1))
                connector.update_state_after_alloc(request, request.block_ids, match[0])
                request.computed = request.num_tokens
                if match[0]:
                    loading[request.request_id] = request
                else:
                    live.append(request)
            waiting = still
            meta = connector.build_connector_meta(SchedulerOutput(scheduled=tuple(
                ScheduledRequest(req_id=r.request_id, block_ids=r.block_ids, num_computed_tokens=r.computed)
                for r in live)))
            failing = {j for j in in_flight if rng.random() < fail_rate}
            report = WorkerOutput(done=tuple(j for j in in_flight if j not in failing), failed=tuple(failing))
            in_flight = [o.job_id for o in (*meta.loads, *meta.stores)]
            result = connector.update_connector_output(ConnectorOutput(workers=(report,)))
            for request_id in result.released:
                free_blocks.extend(held.pop(request_id))
            for request in [loading[r] for r in sorted(loading) if rng.random() < abort_rate]:
                del loading[request.request_id]
                if connector.request_finished(request.request_id, aborted=True):
                    held[request.request_id] = request.block_ids
                else:
                    free_blocks.extend(request.block_ids)
            live += [loading.pop(r) for r in sorted(result.loaded) if r in loading]
            still_live = []
            for request in live:
                request.steps_left -= 1
                aborted = rng.random() < abort_rate
                if request.steps_left > 0 and not aborted:
                    request.computed += 1
                    still_live.append(request)
                elif connector.request_finished(request.request_id, aborted=aborted):
                    held[request.request_id] = request.block_ids
                else:
                    free_blocks.extend(request.block_ids)
            live = still_live
        gc.collect()
        end, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return SoakResult(requests, warm, end, peak)


def new_connector(keep_history: bool = False, cpu_blocks: int = 48) -> SchedulerConnector:
    return SchedulerConnector(OffloadConfig(cpu_blocks=cpu_blocks, gpu_block_size=BLOCK_TOKENS), 1 << 20,
                              keep_history=keep_history)


def main(requests: int = typer.Option(100_000, help="requests to run"),
         warmup: int = typer.Option(2_000, help="requests before the first measurement")) -> None:
    """Soak the scheduler half and print how much its traced memory grew after the warm-up."""
    result = soak(new_connector(), requests, warmup)
    typer.echo(f"{result.requests:,} requests: {result.warm_bytes / 1024:.1f} KiB after {warmup:,}, "
               f"{result.end_bytes / 1024:.1f} KiB at the end (growth {result.growth_bytes / 1024:+.1f} KiB), "
               f"peak {result.peak_bytes / 1024:.1f} KiB")


if __name__ == "__main__":
    typer.run(main)
