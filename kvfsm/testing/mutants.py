"""Controls: kvfsm with one guarded rule removed, each the shape of a bug an engine really shipped.

A mutant patches one running engine + connector pair (instance attributes only, nothing global), so the same
generated interleavings run against kvfsm and against each mutant. The suite must find a failing interleaving for
every mutant; a mutant that survives means the checks are too weak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvfsm.connector import Connector
from kvfsm.engine.engine import Engine
from kvfsm.manager.catalogue import Lookup
from kvfsm.states import CpuBlockState


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str
    """The spec invariant (and the public bug) the mutant reintroduces."""
    apply: Callable[[Engine, Connector], None]


def _no_compute_barrier(engine: Engine, connector: Connector) -> None:
    worker = connector.worker
    worker._wait_for_compute = lambda job: worker._compute_done.pop(job.job_id)  # type: ignore[method-assign]


def _no_preemption_flush(engine: Engine, connector: Connector) -> None:
    connector.worker.handle_preemptions = lambda: None  # type: ignore[method-assign]


def _no_load_dedup(engine: Engine, connector: Connector) -> None:
    manager = connector.scheduler.manager
    pin = manager._machine

    def lookup(hashes: Sequence[int], every_busy: bool = True) -> Lookup:
        hits = 0
        for block_hash in hashes:
            slot = manager.catalogue.get(block_hash)
            if slot is None or manager.blocks[slot].state not in (CpuBlockState.READY, CpuBlockState.LOADING):
                break
            hits += 1
        return Lookup(hits, ())

    def prepare_load(hashes: Sequence[int], job_id: int | None = None) -> tuple[int, ...]:
        slots = tuple(manager.catalogue[h] for h in hashes)
        pin.fire_many([manager.blocks[s] for s in slots], "pin", job_id=job_id)
        return slots

    manager.lookup = lookup  # type: ignore[method-assign]
    manager.prepare_load = prepare_load  # type: ignore[method-assign]


def _no_write_after_read_wait(engine: Engine, connector: Connector) -> None:
    connector.worker._wait_for_readers = lambda job: None  # type: ignore[method-assign]


def _no_fence(engine: Engine, connector: Connector) -> None:
    scheduler = connector.scheduler
    finished = scheduler.request_finished

    def request_finished(request_id: str, aborted: bool = False) -> bool:
        finished(request_id, aborted)
        return False  # the engine frees the blocks while stores still read them

    scheduler.request_finished = request_finished  # type: ignore[method-assign]


def _unpinned_load(engine: Engine, connector: Connector) -> None:
    manager = connector.scheduler.manager
    prepare, complete = manager.prepare_load, manager.complete_load

    def prepare_load(hashes: Sequence[int], job_id: int | None = None) -> tuple[int, ...]:
        slots = prepare(hashes, job_id)
        complete(slots)  # readers dropped at once: the block is evictable while the load still reads it
        return slots

    manager.prepare_load = prepare_load  # type: ignore[method-assign]
    manager.complete_load = lambda slots: None  # type: ignore[method-assign]


MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant("no-compute-barrier", "store-after-compute (vLLM 31341, 46278)", _no_compute_barrier),
        Mutant("no-preemption-flush", "fence (vLLM 29870)", _no_preemption_flush),
        Mutant("no-load-dedup", "single-load (vLLM 29087)", _no_load_dedup),
        Mutant("no-write-after-read-wait", "load-after-readers (vLLM 47282)", _no_write_after_read_wait),
        Mutant("no-fence", "fence (finished request's blocks reused mid-store)", _no_fence),
        Mutant("unpinned-load", "readers-pin (TRT-LLM two writers of one host block)", _unpinned_load),
    )
}
