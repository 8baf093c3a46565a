"""The whole scheduler half per engine step: µs per block transition with 256 running requests of 2k-token prompts.

`kvfsm.bench.scheduler` prices the host pool's bookkeeping alone; this prices everything `SchedulerConnector`
does for a step (lookups, allocation, the step's orders for every scheduled request, completions, releases),
with the request, transfer-job and GPU-block machines as well as the CPU-block one. Each step a sixteenth of the
running requests finish and as many new ones arrive; prompts are drawn by Zipf popularity from a fixed set of
documents so some hit the pool in full, some in part, and a few are deferred behind another request's transfer.
A worker is simulated: a load finishes in the step that submits it, a store in the step after it was ordered.
GPU block ids come from a fixed pool and are reused once a request's blocks are freed, as an engine's are.

`steady_decode` prices the common step: every request running and stored, decoding one token, none completing
a block. The half should cost (nearly) nothing per request then.

The workload is run twice with the same seed: once with an observer counting every transition the machines
fire, once timed without it (an observer costs more than the transitions it counts).

The garbage collector stays on while the half is timed, and the collections it ran then are reported. Before the
timed part one full collection runs: a connector is made once, at an engine's start, and its up-front records (a
CPU slot each, a GPU fence each: ~100k objects) are promoted out of the young generations long before the engine's
steady state; left to the collector, that one promotion is a full collection of every object of the process,
which landed inside some timed runs and not others (0.88 to 1.49 µs per CPU-block transition on one host).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from kvfsm.bench.policies import ADMISSIONS
from kvfsm.bindings import default_spec
from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import ConnectorOutput, ScheduledRequest, SchedulerOutput, WorkerOutput
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.machines import MachineSet

GPU_BLOCK_BYTES = 2 << 20  # Llama-3-8B, 16 tokens: only sizes the pool here


@dataclass
class _Request:
    request_id: str
    block_hashes: tuple[int, ...]
    num_tokens: int
    block_ids: tuple[int, ...] = ()
    computed: int = 0
    steps_left: int = 0


@dataclass
class _World:
    """The engine side: who is waiting, loading, running; what the simulated worker finishes when."""

    waiting: list[_Request] = field(default_factory=list)
    loading: dict[str, _Request] = field(default_factory=dict)
    running: list[_Request] = field(default_factory=list)
    stores_in_flight: tuple[int, ...] = ()
    free_blocks: list[int] = field(default_factory=list)
    next_block: int = 0
    held: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Blocks of finished requests the connector still holds (their stores are in flight)."""

    def allocate(self, n: int) -> tuple[int, ...]:
        fresh = max(0, n - len(self.free_blocks))
        self.free_blocks.extend(range(self.next_block, self.next_block + fresh))
        self.next_block += fresh
        blocks = tuple(self.free_blocks[-n:])
        del self.free_blocks[-n:]
        return blocks


class _Stopwatch:
    """Wall time and this thread's CPU time of the timed sections. Wall time is what an engine waits; CPU time is
    what the half itself costs, and stays put on a shared host where the process is descheduled mid-step."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self._wall = self._cpu = 0.0

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def stop(self) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.thread_time() - self._cpu


def _collections() -> list[int]:
    return [generation["collections"] for generation in gc.get_stats()]


def _collected_since(before: list[int]) -> dict[str, int]:
    """The collections of each generation since `before` (from `_collections`)."""
    return {f"gen{g}": after - b for g, (after, b) in enumerate(zip(_collections(), before))}


def _workload(connector: SchedulerConnector, steps: int, requests: int, prompt_tokens: int, lifetime: int,
              documents: int, seed: int) -> _Stopwatch:
    """Drive `connector` for `steps` steps; returns the time spent inside it."""
    rng = random.Random(seed)
    block = connector.config.gpu_block_size
    blocks = prompt_tokens // block
    popularity = [1.0 / (rank + 1) for rank in range(documents)]
    world = _World()
    serial = 0
    watch = _Stopwatch()
    for step in range(steps):
        arrivals = requests - len(world.running) - len(world.loading) - len(world.waiting)
        for _ in range(max(0, arrivals if step else requests)):
            doc = rng.choices(range(documents), popularity)[0]
            serial += 1
            world.waiting.append(_Request(f"r{serial}", tuple(doc << 20 | j for j in range(blocks)),
                                          prompt_tokens + 1, steps_left=lifetime))
        admitted: list[_Request] = []
        watch.start()
        still_waiting = []
        for request in world.waiting:
            match = connector.get_num_new_matched_tokens(request, 0)
            if match is None:
                still_waiting.append(request)
                continue
            request.block_ids = world.allocate(blocks + 1)
            connector.update_state_after_alloc(request, request.block_ids, match[0])
            if match[0]:
                world.loading[request.request_id] = request
            else:
                admitted.append(request)
        watch.stop()
        world.waiting = still_waiting
        world.running.extend(admitted)
        for request in world.running:
            request.computed = request.num_tokens if request.computed == 0 else request.computed + 1
        scheduled = SchedulerOutput(scheduled=tuple(
            ScheduledRequest(req_id=r.request_id, block_ids=r.block_ids, num_computed_tokens=r.computed)
            for r in world.running))
        watch.start()
        meta = connector.build_connector_meta(scheduled)
        watch.stop()
        done = WorkerOutput(done=tuple(o.job_id for o in meta.loads) + world.stores_in_flight)
        world.stores_in_flight = tuple(o.job_id for o in meta.stores)
        report = ConnectorOutput(workers=(done,))
        watch.start()
        result = connector.update_connector_output(report)
        finishing = [r for r in world.running if r.steps_left <= 1]
        held = [connector.request_finished(request.request_id) for request in finishing]
        watch.stop()
        for request, keep in zip(finishing, held):
            if keep:
                world.held[request.request_id] = request.block_ids
            else:
                world.free_blocks.extend(request.block_ids)
        for request_id in result.released:
            world.free_blocks.extend(world.held.pop(request_id))
        for request_id in result.loaded:
            world.running.append(world.loading.pop(request_id))
        ended = {r.request_id for r in finishing}
        world.running = [r for r in world.running if r.request_id not in ended]
        for request in world.running:
            request.steps_left -= 1
    return watch


def run(steps: int = 48, requests: int = 256, prompt_tokens: int = 2048, lifetime: int = 16,
        documents: int = 512, num_slots: int = 32768, seed: int = 0, repeats: int = 3,
        eviction: str = "lru", admission: str = "every-block") -> dict[str, float | int | list[float] | dict[str, int]]:
    """µs per step and per block transition (CPU-block, and every lifecycle) of the scheduler half.

    `admission` names one of `kvfsm.bench.policies.ADMISSIONS` (the `OffloadConfig` fields it sets). A block it
    skips is decided (the request's `skip-store` names it) but never moves, so besides the figure per CPU-block
    transition the run reports one per block decision: CPU-block transitions plus blocks skipped. The timed
    workload runs `repeats` times, each on a fresh connector; the figures are the fastest run's (noise on a shared
    host only adds time), with every run's wall and CPU µs per CPU-block transition listed beside them."""
    settings = ADMISSIONS[admission]

    def connector(machines: MachineSet | None = None) -> SchedulerConnector:
        return SchedulerConnector(OffloadConfig(cpu_blocks=num_slots, eviction=eviction, **settings), GPU_BLOCK_BYTES,
                                  machines,
                                  num_gpu_blocks=2 * requests * (prompt_tokens // 16 + 1))  # the engine's pool

    fired: Counter[str] = Counter()
    machines = MachineSet(default_spec())
    machines.observe(lambda lifecycle, _model, _source, _trigger, _dest: fired.update([lifecycle]))
    counted = connector(machines)
    _workload(counted, steps, requests, prompt_tokens, lifetime, documents, seed)
    counted_hits = counted.stats.cpu_hit_blocks
    skipped = counted.stats.blocks_skipped_prompt_only + counted.stats.blocks_skipped_threshold
    del counted, machines  # not kept alive beside the timed one: a full collection would walk both
    runs: list[tuple[_Stopwatch, dict[str, int]]] = []
    for _ in range(repeats):
        timed = connector()
        gc.collect()  # the start-up promotion of its records, out of the timed part (see the module's docstring)
        before = _collections()
        watch = _workload(timed, steps, requests, prompt_tokens, lifetime, documents, seed)
        runs.append((watch, _collected_since(before)))
        stats = timed.stats
        if stats.cpu_hit_blocks != counted_hits:
            raise RuntimeError("the counted and the timed runs diverged: the transition count would not apply")
        del timed
    fastest, collected = min(runs, key=lambda run: run[0].wall)
    seconds, cpu_block, total = fastest.wall, fired["cpu-block"], sum(fired.values())
    return {
        "steps": steps,
        "running_requests": requests,
        "prompt_tokens": prompt_tokens,
        "us_per_step": seconds / steps * 1e6,
        "us_per_cpu_block_transition": seconds / cpu_block * 1e6,
        "cpu_us_per_cpu_block_transition": min(w.cpu for w, _ in runs) / cpu_block * 1e6,
        "runs_us_per_cpu_block_transition": [w.wall / cpu_block * 1e6 for w, _ in runs],
        "runs_cpu_us_per_cpu_block_transition": [w.cpu / cpu_block * 1e6 for w, _ in runs],
        "us_per_transition": seconds / total * 1e6,
        "blocks_skipped": skipped,
        "us_per_block_decision": seconds / (cpu_block + skipped) * 1e6,
        "transitions": dict(fired),
        "cpu_hit_blocks": stats.cpu_hit_blocks,
        "deferrals": stats.deferrals,
        "store_refusals": stats.store_refusals,
        "gc_collections": collected,
    }


def steady_decode(requests: int = 256, prompt_tokens: int = 2048, num_slots: int = 65536, seed: int = 0,
                  rounds: int = 3) -> dict[str, float | int | list[float] | dict[str, int]]:
    """µs per step of the scheduler half while `requests` stored requests each decode a token, none completing a block.

    Each of `rounds` rounds (a fresh connector and requests) gives its median step; the figure is the fastest
    round's median (noise on a shared host only adds time, and can slow a whole round), with every round's and the
    slowest single step listed, in wall and in this thread's CPU time.

    Requests are admitted, computed and stored first (untimed); then every step up to the next block boundary is
    timed from `build_connector_meta` through `update_connector_output`, the engine's schedule and its workers'
    report built outside (as `_workload` builds them: pydantic messages the engine makes, ~3 µs for the report)."""
    config = OffloadConfig(cpu_blocks=num_slots)
    block = config.gpu_block_size
    blocks = prompt_tokens // block
    samples: list[list[float]] = []  # per round, wall
    cpu_samples: list[list[float]] = []
    before: list[int] = []
    collected: dict[str, int] = {}
    for round_ in range(rounds):
        samples.append([])
        cpu_samples.append([])
        connector = SchedulerConnector(config, GPU_BLOCK_BYTES, num_gpu_blocks=requests * (blocks + 1))
        running = [_Request(f"r{i}", tuple((seed + round_) << 40 | i << 20 | j for j in range(blocks)),
                            prompt_tokens + 1) for i in range(requests)]
        for i, request in enumerate(running):
            assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
            request.block_ids = tuple(range(i * (blocks + 1), (i + 1) * (blocks + 1)))
            connector.update_state_after_alloc(request, request.block_ids, 0)
            request.computed = request.num_tokens
        pending: tuple[int, ...] = ()
        first = True
        gc.collect()  # the start-up promotion, out of the timed steps (see the module's docstring)
        before = _collections()
        while True:
            output = SchedulerOutput(scheduled=tuple(
                ScheduledRequest(req_id=r.request_id, block_ids=r.block_ids, num_computed_tokens=r.computed)
                for r in running))
            report = ConnectorOutput(workers=(WorkerOutput(done=pending),))  # the engine's, as its schedule is
            quiet = not first and not pending and all(r.computed % block for r in running)
            watch = _Stopwatch()
            watch.start()
            meta = connector.build_connector_meta(output)
            connector.update_connector_output(report)
            watch.stop()
            if quiet:
                if meta.stores or meta.loads:
                    raise RuntimeError("a quiet decode step ordered transfers: the figure would price other work")
                samples[-1].append(watch.wall)
                cpu_samples[-1].append(watch.cpu)
            pending, first = tuple(o.job_id for o in meta.stores), False
            if quiet and (running[0].computed + 1) % block == 0:
                break
            for request in running:
                request.computed += 1
        for generation, count in _collected_since(before).items():
            collected[generation] = collected.get(generation, 0) + count
    medians = [statistics.median(round_) * 1e6 for round_ in samples]
    cpu_medians = [statistics.median(round_) * 1e6 for round_ in cpu_samples]
    return {"running_requests": requests, "steps": sum(map(len, samples)), "rounds": rounds,
            "us_per_step": min(medians), "us_per_step_rounds": medians,
            "us_per_step_max": max(map(max, samples)) * 1e6,
            "cpu_us_per_step": min(cpu_medians), "cpu_us_per_step_rounds": cpu_medians,
            "cpu_us_per_step_max": max(map(max, cpu_samples)) * 1e6, "gc_collections": collected}
