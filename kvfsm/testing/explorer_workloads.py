"""The small workloads the exhaustive explorer enumerates, and the host actions they are scripted from.

A `Workload` is what the host does (arrivals, steps, preemptions, resets, armed faults) and how large its pools and
lower tier are; the catalogues (`SMALL_WORKLOADS`, `TP_WORKLOADS`, `POLICY_WORKLOADS`, `TIER_WORKLOADS`,
`MOONCAKE_WORKLOADS`) are the scenarios that between them reach every hazard. They live apart from the search
(`kvfsm.testing.explorer`) because the GPU engine tests and the policy conformance suite use the same scenarios,
and because a new hazard adds a workload here without touching how schedules are enumerated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvfsm.testing.copy_faults import Direction, Stage
from kvfsm.testing.harness import Harness

HostAction = Callable[[Harness], None]


@dataclass(frozen=True)
class Workload:
    actions: tuple[HostAction, ...]
    num_gpu_blocks: int = 6
    cpu_blocks: int = 3
    block_size_factor: int = 1
    max_extra_steps: int = 12
    """Engine steps the host may still take after its scripted actions, to finish the requests."""
    per_layer: bool = False
    """The engine computes layer by layer and calls the per-layer hooks."""
    layer_loads: bool = False
    layer_stores: bool = False
    disk_slots: int = 0
    """Slots of a disk tier below the CPU pool (0: none); its reads and writes are one more choice, "io"."""
    mooncake: bool = False
    """A Mooncake tier below the CPU pool, on this process's shared local master (a tenant of its own per replay);
    its calls queue like the disk's, the same "io" choice."""
    writeback_bound_blocks: int = 4
    device_eager: bool = False
    """The device runs every operation as soon as it is queued: only the host and the tier's I/O are choices (the
    streams' interleavings are the other workloads' subject; each replay of a Mooncake workload does real network
    I/O, so its schedules are kept few)."""

    staging_blocks: int | None = None
    """Staging slots this many GPU blocks long: a step's stores go out as a pipeline of that many-block chunks."""
    ranks: int = 1
    """Tensor-parallel ranks, each on its own SimDevice holding its share of the heads."""
    replicated: bool = False
    """With several ranks: every rank holds every head's KV (MLA) and the ranks share one host pool."""
    store_threshold: int = 1
    """Times a block must be offered before it is stored (admission's threshold rule; 1 stores every block)."""
    eviction: str = "lru"
    """The CPU pool's eviction policy (`OffloadConfig.eviction`): the policy conformance suite explores with its own."""
    store_bound: int | None = None
    """CPU blocks of stores in flight beyond which new ones are shed (`store_max_blocks_in_flight`; None: no bound)."""
    writeback_queue_blocks: int | None = None
    """The disk tier's bound on its stored blocks waiting for write-back (`writeback_max_queued_blocks`)."""

    @property
    def tier(self) -> str | None:
        """The lower tier this workload runs with, as `kvfsm.testing.mutants.Mutant.tier` names it."""
        return "mooncake" if self.mooncake else "disk" if self.disk_slots else None


def add(prompt: Sequence[int], max_new_tokens: int) -> HostAction:
    def arrive(h: Harness) -> None:
        h.add_request(tuple(prompt), max_new_tokens)

    return arrive


def step(h: Harness) -> None:
    h.engine.step()


def preempt_first(h: Harness) -> None:
    if h.engine.running:
        h.engine.preempt(h.engine.running[0].request_id)


def preempt_first_reclaiming(h: Harness) -> None:
    """Preempt as memory pressure does: the request's blocks are the next ones handed out (and rewritten by the
    step that takes them)."""
    if h.engine.running:
        h.engine.preempt(h.engine.running[0].request_id, reclaim=True)


def forget_gpu_prefixes(h: Harness) -> None:
    h.engine.reset_prefix_cache()


def reset_offload_cache(h: Harness) -> None:
    """A cache reset of the connector: CPU blocks leave the catalogue, write-backs in flight are orphaned."""
    h.connector.reset_cache()


def fail_next(direction: Direction, rank: int = 0, stage: Stage = "check", after: int = 0) -> HostAction:
    """Arm `rank`'s next store or load to fail at `stage` (`kvfsm.testing.copy_faults`; the other ranks' copies of
    that job succeed)."""
    def arm(h: Harness) -> None:
        h.rank_faults[rank].arm(direction, stage, after)

    return arm


def tier_fault(fault: str) -> HostAction:
    def inject(h: Harness) -> None:
        h.tier_faults.inject(fault)

    return inject


_P, _Q = (11, 12, 13, 14), (21, 22, 23, 24)
SMALL_WORKLOADS: dict[str, Workload] = {
    "reload": Workload(
        actions=(add(_P + (1,), 1), step, step, step, forget_gpu_prefixes, add(_P + (2,), 1), add(_P + (3,), 1),
                 step, step),
        num_gpu_blocks=6, cpu_blocks=3,
    ),
    "mixed": Workload(
        actions=(add(_P + (1,), 1), step, add(_P + (2, 3), 1), step, preempt_first, step, forget_gpu_prefixes,
                 add(_P + (4,), 1), step),
        num_gpu_blocks=6, cpu_blocks=3,
    ),
    "pressure": Workload(
        actions=(add(_Q + (5,), 3), step, add(_P + (1, 2), 2), step, step, step),
        num_gpu_blocks=6, cpu_blocks=5,
    ),
    "reload-per-layer": Workload(
        actions=(add(_P + (1,), 1), step, step, step, forget_gpu_prefixes, add(_P + (2,), 1), step, step),
        num_gpu_blocks=6, cpu_blocks=3, per_layer=True, layer_loads=True,
    ),
    "preempt-per-layer-store": Workload(
        actions=(add(_P + (1,), 2), step, preempt_first_reclaiming, step, add(_Q + (5,), 1), step, step),
        num_gpu_blocks=6, cpu_blocks=3, per_layer=True, layer_stores=True,
    ),
    "preempt-mid-copy": Workload(
        actions=(add(_P + (1,), 3), step, step, preempt_first_reclaiming, step, add(_Q + (5,), 1), step),
        num_gpu_blocks=6, cpu_blocks=3,
    ),
    "reload-fails-mid-copy": Workload(
        actions=(add(_P + (1,), 1), step, step, step, forget_gpu_prefixes, fail_next("load", stage="copy", after=1),
                 add(_P + (2,), 1), step, step),
        num_gpu_blocks=6, cpu_blocks=3,
    ),
    "flush-fails-mid-copy": Workload(
        actions=(add(_P + (1,), 3), step, fail_next("store", stage="copy", after=1), preempt_first_reclaiming, step,
                 add(_Q + (5,), 1), step),
        num_gpu_blocks=6, cpu_blocks=3, staging_blocks=1,
    ),
    "offered-twice": Workload(
        actions=(add(_P + (1,), 1), step, step, forget_gpu_prefixes, add(_P + (2,), 1), step, step),
        num_gpu_blocks=6, cpu_blocks=3, store_threshold=2,
    ),
    "end-then-reuse": Workload(
        actions=(add(_P + (1,), 1), step, add(_Q + (5, 6, 7, 8, 9, 10), 2), step, step),
        num_gpu_blocks=6, cpu_blocks=8,
    ),
    "store-bound": Workload(
        actions=(add(_P + (1,), 1), add(_Q + (5,), 1), step),
        num_gpu_blocks=6, cpu_blocks=4, store_bound=1, max_extra_steps=6,
    ),
}
"""Small workloads that between them reach every hazard: a stored prefix reloaded by two requests at once after
the GPU forgot it; three requests sharing a prefix with a forced preemption; a running request that preempts
another mid-store to grow; with an engine that computes layer by layer and calls the per-layer hooks, a reload
computed in the step that loads it, and a request preempted while its per-layer stores are in flight; and a request
preempted under memory pressure a step after its store was submitted, so the store may still be on the copy stream
when another request is handed its blocks and rewrites them (vLLM 29870); a reload whose load fails after its first
layer was sent, recomputed while that layer may still be copying; and a request preempted under memory pressure whose store, flushed as a
pipeline of one-block chunks, fails after its first chunk was sent; and a prefix offered once (skipped under a
store threshold of two), then again (stored); and a request that ends in the step that orders its store, whose
blocks the next step hands to another request at once (`lazy-fence`); and two requests whose stores start in one
step under a bound of one block in flight, the rest shed (`stores-bounded`)."""

TP_WORKLOADS: dict[str, Workload] = {
    "tp-preempt-mid-copy": Workload(
        actions=(add(_P + (1,), 3), step, step, preempt_first_reclaiming, step, add(_Q + (5,), 1), step),
        num_gpu_blocks=6, cpu_blocks=3, ranks=2,
    ),
    "tp-store-fails-on-rank-1": Workload(
        actions=(fail_next("store", rank=1), add(_P + (1,), 1), step, step),
        num_gpu_blocks=6, cpu_blocks=3, ranks=2, max_extra_steps=6,
    ),
    "tp-reload": Workload(
        actions=(add(_P + (1,), 1), step, step, forget_gpu_prefixes, add(_P + (2,), 1), step),
        num_gpu_blocks=6, cpu_blocks=3, ranks=2, max_extra_steps=8,
    ),
    "tp-replicated-reload": Workload(
        actions=(add(_P + (1,), 1), step, step, forget_gpu_prefixes, add(_P + (2,), 1), step),
        num_gpu_blocks=6, cpu_blocks=3, ranks=2, max_extra_steps=8, replicated=True,
    ),
}
"""Two ranks: a request preempted under memory pressure while its store may still be copying on either rank; a stored
prefix whose store fails on rank 1 while rank 0's copy succeeds; a stored prefix reloaded after the GPU forgot it
(each rank's store and load report in any order); and that reload with replicated (MLA) KV, one shared host pool
written by each store's writer rank alone."""

POLICY_WORKLOADS: dict[str, Workload] = {
    "evict-while-loading": Workload(
        actions=(add(_P + (1,), 1), step, step, step, forget_gpu_prefixes, add(_P + (2,), 1), add(_Q + (5,), 1),
                 step),
        num_gpu_blocks=6, cpu_blocks=3, max_extra_steps=6,
    ),
}
"""For the eviction-policy conformance suite (`kvfsm.testing.conformance`): a stored two-block prefix reloaded while
another request's two blocks are stored into a three-slot pool, so some schedules plan that store (one eviction)
while the prefix's blocks are being loaded and the only other slot is free or still being stored."""

_A, _B = (11, 12), (21, 22)
TIER_WORKLOADS: dict[str, Workload] = {
    "disk-reset": Workload(
        actions=(add(_A + (13, 14, 1), 1), step, step, step, step, reset_offload_cache, forget_gpu_prefixes,
                 add(_A + (13, 14, 2), 1), step),
        num_gpu_blocks=6, cpu_blocks=2, disk_slots=2, writeback_bound_blocks=1, max_extra_steps=6,
    ),
    "disk": Workload(
        actions=(add(_A + (1,), 1), step, step, step, step, step, forget_gpu_prefixes, add(_B + (5,), 1), step, step,
                 step, step, step, forget_gpu_prefixes, add(_A + (2,), 1), step),
        num_gpu_blocks=4, cpu_blocks=1, disk_slots=2, writeback_bound_blocks=1, max_extra_steps=6,
    ),
    "disk-faults": Workload(
        actions=(add(_A + (1,), 1), step, step, step, step, step, forget_gpu_prefixes, add(_B + (5,), 1), step, step,
                 step, step, step, forget_gpu_prefixes, tier_fault("evict-before-fetch"), add(_A + (2,), 1), step),
        num_gpu_blocks=4, cpu_blocks=1, disk_slots=2, writeback_bound_blocks=1, max_extra_steps=6,
    ),
    "disk-stall": Workload(
        actions=(add(_A + (1,), 1), step, step, step, step, step, forget_gpu_prefixes, add(_B + (5,), 1), step, step,
                 step, step, step, forget_gpu_prefixes, add(_A + (2,), 1), step, tier_fault("stall"), step),
        num_gpu_blocks=4, cpu_blocks=1, disk_slots=2, writeback_bound_blocks=1, max_extra_steps=6,
    ),
    "disk-queue-bound": Workload(
        actions=(add(_A + (1,), 1), add(_B + (5,), 1), step),
        num_gpu_blocks=4, cpu_blocks=2, disk_slots=2, writeback_bound_blocks=1, writeback_queue_blocks=1,
        max_extra_steps=6,
    ),
}
"""A two-block prefix stored at once (two write-back candidates against a one-block bound) whose cache is reset while
its write-back may still run, then looked up again (the disk still writing its key); a one-block prefix written
back to disk, pushed out of a one-slot CPU pool by another, and fetched back when it returns; the same with its
key evicted between the lookup and the fetch; and with the disk hanging past the fetch's deadline (in a one-slot
pool: a lookup may meet that slot busy, `fetch-waits-for-room`); and two stores ending in either order while the
disk's write-back queue holds one block (`writeback-queue-bounded`). The cheapest first: a mutant's search stops at the first workload that shows it."""

MOONCAKE_WORKLOADS: dict[str, Workload] = {
    "mooncake-reset": Workload(
        actions=(add(_A + (1,), 1), step, step, step, step, step, reset_offload_cache, forget_gpu_prefixes,
                 add(_A + (2,), 1), step),
        num_gpu_blocks=4, cpu_blocks=1, mooncake=True, writeback_bound_blocks=1, max_extra_steps=6,
        device_eager=True,
    ),
}
"""A one-block prefix written back to a shared Mooncake store, then its cache reset (CPU blocks and the tier's
own index forgotten, the store keeping the object, as if another engine had written it) while the write may still
run, and the prefix looked up again: the lookup asks the store and adopts the key if the store holds it whole, and
fetches it. The device runs eagerly: the store's calls against the host's steps are what is enumerated."""
