"""Scheduler-side cost of the host pool's bookkeeping: µs per CPU-block transition, and the policies on a scan.

The per-step workload is what a scheduler does with the manager for a batch of running requests: look each
prompt up, load its ready prefix (pin, then unpin next step), store the rest (allocate now, submit and complete
over the next step, a few failing), touching hits, over a pool small enough that stores keep evicting. The time of
every manager call is divided by the number of `cpu-block` transitions those calls fired, so the figure is the
amortized price of keeping every state change inside the spec's machine.

Run `python -m kvfsm.bench.scheduler`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from kvfsm.machines import MachineSet
from kvfsm.manager import BlockRemoved, OffloadingManager
from kvfsm.manager.policies import BUILTIN, PolicyName

POLICIES = tuple(name for name in BUILTIN if name != "w-tinylfu")  # w-tinylfu is tinylfu's other name

@dataclass
class _Step:
    """What one step started: its loads end next step; its stores are submitted next step and end the one after."""

    loads: list[tuple[int, ...]] = field(default_factory=list)
    stores: list[tuple[int, ...]] = field(default_factory=list)


def _prompts(documents: int, blocks: int) -> list[list[int]]:
    """One block-hash chain per document; the engine's GPU prefix cache serves any head they share."""
    return [[d << 20 | i for i in range(blocks)] for d in range(documents)]


def run(policy: PolicyName = "lru", steps: int = 24, requests: int = 256, prompt_tokens: int = 2048,
        block_tokens: int = 16, num_slots: int = 65536, documents: int = 1024, fail_rate: float = 0.01,
        seed: int = 0, machines: MachineSet | None = None) -> dict[str, float]:
    """One run of the per-step workload; returns µs per transition and what was counted (`machines`: to observe)."""
    rng = random.Random(seed)
    blocks = prompt_tokens // block_tokens
    prompts = _prompts(documents, blocks)
    popularity = [1.0 / (rank + 1) for rank in range(documents)]  # Zipf: a few prompts are asked often
    manager = OffloadingManager(num_slots, policy, machines)
    transitions = hits = looked_up = deferred = refused = 0
    elapsed = 0.0
    older, previous = _Step(), _Step()
    job_id = 0
    for _ in range(steps):
        chosen = rng.choices(prompts, popularity, k=requests)
        failed = [rng.random() < fail_rate for _ in older.stores]
        current = _Step()
        start = time.perf_counter()
        for slots, fail in zip(older.stores, failed):
            manager.complete_store(slots, not fail)
        for slots in previous.stores:
            manager.mark_submitted(slots)
        for slots in previous.loads:
            manager.complete_load(slots)
        for hashes in chosen:
            found = manager.lookup(hashes)
            looked_up += len(hashes)
            if found.busy:
                deferred += 1
                continue
            if found.hits:
                head = hashes[: found.hits]
                current.loads.append(manager.prepare_load(head))
                manager.touch(head)
                hits += found.hits
            job_id += 1
            plan = manager.prepare_store(hashes, job_id)
            if plan is None:
                refused += 1
            elif plan.slots:
                current.stores.append(plan.slots)
        events = manager.take_events()
        elapsed += time.perf_counter() - start
        transitions += sum(len(s) for s in older.stores)  # store-done | store-failed
        transitions += sum(len(s) for s in previous.stores)  # submit
        transitions += sum(len(s) for s in previous.loads)  # unpin
        transitions += sum(len(s) for s in current.stores) + sum(len(s) for s in current.loads)  # allocate, pin
        transitions += sum(len(e.hashes) for e in events if isinstance(e, BlockRemoved))  # evict
        older, previous = previous, current
    return {
        "us_per_transition": elapsed / transitions * 1e6,
        "transitions": transitions,
        "seconds": elapsed,
        "hit_rate": hits / looked_up,
        "deferred": deferred,
        "refused": refused,
    }


def scan_comparison(policy: PolicyName, num_slots: int = 1024, hot: int = 512, rounds: int = 12,
                    seed: int = 0) -> dict[str, float]:
    """Hit rates while a hot working set is re-used between chunks of a one-off scan as large as the pool.

    Every access is one single-block prompt: a hit loads and touches it, a miss stores it.
    """
    rng = random.Random(seed)
    manager = OffloadingManager(num_slots, policy)
    fresh = iter(range(1 << 30, 1 << 31))
    hot_keys = list(range(hot))
    hot_hits = hot_accesses = all_hits = accesses = 0
    for _ in range(rounds):
        rng.shuffle(hot_keys)
        trace = [(k, True) for k in hot_keys] + [(next(fresh), False) for _ in range(num_slots)]
        for key, is_hot in trace:
            hit = manager.lookup([key]).hits == 1
            if hit:
                manager.complete_load(manager.prepare_load([key]))
                manager.touch([key])
            else:
                plan = manager.prepare_store([key], job_id=key)
                if plan is not None:
                    manager.mark_submitted(plan.slots)
                    manager.complete_store(plan.slots, True)
            accesses += 1
            all_hits += hit
            hot_accesses += is_hot
            hot_hits += hit and is_hot
    return {"hot_hit_rate": hot_hits / hot_accesses, "overall_hit_rate": all_hits / accesses}


def main() -> None:
    console = Console(width=120)
    table = Table(title="OffloadingManager per-step workload (256 requests x 128 blocks, 64k-slot pool)")
    for column in ("policy", "µs / transition", "transitions", "seconds", "block hit rate", "deferred",
                   "refused"):
        table.add_column(column, justify="right")
    for policy in POLICIES:
        r = run(policy)
        table.add_row(policy, f"{r['us_per_transition']:.3f}", f"{r['transitions']:,}", f"{r['seconds']:.2f}",
                      f"{r['hit_rate']:.1%}", str(r["deferred"]), str(r["refused"]))
    console.print(table)
    scan = Table(title="Scan resistance: 512 hot blocks re-used between 1024-block scans, 1024-slot pool")
    for column in ("policy", "hot hit rate", "overall hit rate"):
        scan.add_column(column, justify="right")
    for policy in POLICIES:
        r = scan_comparison(policy)
        scan.add_row(policy, f"{r['hot_hit_rate']:.1%}", f"{r['overall_hit_rate']:.1%}")
    console.print(scan)


if __name__ == "__main__":
    main()
