"""The request streams the vLLM benches play, apart from the runner that plays them.

A `Workload` says what arrives and is aborted at each step and how large vLLM's GPU pool is; the builders here make
the comparison's six streams (`WORKLOADS`, small `QUICK_SIZES` for a plumbing check). They live apart from
`bench.py` (the runner, `Run`/`play`, and the comparison's table) because the inline, hybrid and tiered benches build
streams of their own from the same `Arrival`/`Workload`/`random_tokens` without needing the comparison.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm.v1.core.sched.scheduler import Scheduler

from kvfsm.integrations.vllm.rig import BLOCK_SIZE, kv_cache_config

@dataclass
class Arrival:
    req_id: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Workload:
    """A request stream: `arrivals(step)` are added before that step; steps from `measure_from` on are timed."""

    name: str
    gpu_blocks: int
    steps: int
    arrivals: Callable[[int], list[Arrival]]
    warm: list[Arrival] = field(default_factory=list)
    """Requests run to the end first (their blocks reach the CPU pool), then vLLM's GPU prefix cache is reset."""
    warm_one_by_one: bool = False
    """Each warm-up request arrives once the one before ran to the end (and everything it started ended); else all
    arrive before the first step."""
    measure_from: Callable[[Scheduler], bool] = lambda scheduler: True
    aborts: Callable[[int], list[str]] = lambda step: []
    """Requests aborted before that step (those already finished are ignored)."""
    max_seqs: int = 256
    max_batched_tokens: int = 8192
    cache: Callable[[int], Any] = kv_cache_config
    """The `KVCacheConfig` for this many GPU blocks (one full-attention group unless a workload says otherwise)."""


def random_tokens(seed: int, count: int) -> list[int]:
    """`count` token ids drawn from `seed`: the same prompt on every run, so the connectors see the same stream."""
    rng = random.Random(seed)
    return [rng.randrange(1, 999) for _ in range(count)]


def steady_decode(requests: int = 256, prompt_tokens: int = 2048, steps: int = 160) -> Workload:
    arrivals = [Arrival(f"r{i}", random_tokens(i, prompt_tokens), max_tokens=4 * steps) for i in range(requests)]
    blocks = requests * (prompt_tokens + 4 * steps) // BLOCK_SIZE + requests
    return Workload("steady-decode", blocks, steps, lambda step: arrivals if step == 0 else [],
                    measure_from=lambda scheduler: not scheduler.waiting and all(
                        r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running),
                    max_seqs=requests)


def zipf_prefixes(documents: int = 64, doc_tokens: int = 1024, per_step: int = 8, steps: int = 64,
                  seed: int = 0) -> Workload:
    docs = [random_tokens(10_000 + d, doc_tokens) for d in range(documents)]
    weights = [1.0 / (rank + 1) for rank in range(documents)]
    rng = random.Random(seed)
    stream = [[Arrival(f"s{step}-{i}", doc + random_tokens(step * 1000 + i, 40), max_tokens=16)
               for i, doc in enumerate(rng.choices(docs, weights, k=per_step))] for step in range(steps)]
    warm = [Arrival(f"w{d}", doc + [1], max_tokens=1) for d, doc in enumerate(docs)]
    gpu_blocks = documents * doc_tokens // BLOCK_SIZE // 2  # room for half the documents
    return Workload("zipf-prefixes", gpu_blocks, steps + 40, lambda step: stream[step] if step < steps else [],
                    warm=warm)


def preemption_burst(requests: int = 48, prompt_tokens: int = 512, decode_tokens: int = 192) -> Workload:
    arrivals = [Arrival(f"p{i}", random_tokens(50_000 + i, prompt_tokens), max_tokens=decode_tokens)
                for i in range(requests)]
    gpu_blocks = requests * prompt_tokens // BLOCK_SIZE + requests * decode_tokens // BLOCK_SIZE // 3
    return Workload("preemption-burst", gpu_blocks, decode_tokens + 160, lambda step: arrivals if step == 0 else [],
                    max_seqs=requests, max_batched_tokens=4096)


def abort_storm(waves: int = 12, per_wave: int = 8, prompt_tokens: int = 512, decode_tokens: int = 256,
                abort_after: int = 40, wave_steps: int = 16) -> Workload:
    """Every `wave_steps` steps `per_wave` requests arrive; each is aborted `abort_after` steps after it arrived,
    mid-decode, its stores still in flight."""
    def wave(step: int) -> int | None:
        return step // wave_steps if step % wave_steps == 0 and step // wave_steps < waves else None

    def arrivals(step: int) -> list[Arrival]:
        w = wave(step)
        return [] if w is None else [Arrival(f"a{w}-{i}", random_tokens(70_000 + w * per_wave + i, prompt_tokens),
                                             max_tokens=decode_tokens) for i in range(per_wave)]

    def aborts(step: int) -> list[str]:
        w = wave(step - abort_after) if step >= abort_after else None
        return [] if w is None else [f"a{w}-{i}" for i in range(per_wave)]

    gpu_blocks = 2 * per_wave * (prompt_tokens + decode_tokens) // BLOCK_SIZE
    return Workload("abort-storm", gpu_blocks, waves * wave_steps + abort_after + 8, arrivals, aborts=aborts,
                    max_seqs=4 * per_wave, max_batched_tokens=4096)


def abort_storm_early(**sizes: int) -> Workload:
    """The abort storm with each request aborted two steps after it arrived, its prompt's stores still in flight (a
    client that cancels right after submitting): what `request_finished` makes vLLM hold shows here."""
    workload = abort_storm(**{"abort_after": 2, **sizes})
    workload.name = "abort-storm-early"
    return workload


def preemption_burst_tail(**sizes: int) -> Workload:
    """The preemption burst with each request's last token completing a block, so it finishes with that block's
    store in flight."""
    workload = preemption_burst(**{"decode_tokens": 193, **sizes})
    workload.name = "preemption-burst-tail"
    return workload


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "steady-decode": steady_decode, "zipf-prefixes": zipf_prefixes, "preemption-burst": preemption_burst,
    "abort-storm": abort_storm, "abort-storm-early": abort_storm_early, "preemption-burst-tail": preemption_burst_tail,
}
QUICK_SIZES: dict[str, dict[str, int]] = {
    "steady-decode": {"requests": 16, "prompt_tokens": 256, "steps": 20},
    "zipf-prefixes": {"documents": 8, "doc_tokens": 256, "per_step": 2, "steps": 10},
    "preemption-burst": {"requests": 8, "prompt_tokens": 128, "decode_tokens": 64},
    "abort-storm": {"waves": 3, "per_wave": 4, "prompt_tokens": 128, "decode_tokens": 64, "abort_after": 8,
                    "wave_steps": 4},
    "abort-storm-early": {"waves": 3, "per_wave": 4, "prompt_tokens": 128, "decode_tokens": 64, "wave_steps": 4},
    "preemption-burst-tail": {"requests": 8, "prompt_tokens": 128, "decode_tokens": 65},
}
"""Small sizes: check the plumbing in seconds, not the figures."""
