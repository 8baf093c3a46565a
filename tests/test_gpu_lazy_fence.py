"""`lazy-fence` on a real GPU: an ended request's blocks handed out again at once while its store still copies them.

A request finishes (or is aborted) in the step that orders its store; the next step hands its blocks to another
request, whose forward (and the engine's poison of freshly allocated blocks) writes them. The copy engine is made
busy before each store (a sleep on the store stream), so a store that nobody waits for reads its blocks after that
write. kvfsm flushes the store in the reusing step and the worker waits for it: every trial keeps its CPU bytes,
outputs and the spec's invariants. The control, `no-lazy-fence`, lets the step write the blocks under the store:
the CPU pool publishes the next request's bytes under the first request's prefix.
"""

from __future__ import annotations

import pytest
import torch

from kvfsm.testing.harness import Harness

pytestmark = pytest.mark.gpu

TRIALS = 20
DELAY = 50_000_000  # cycles the store stream sleeps before each store (~25 ms: longer than a host step)
FIRST, SECOND = tuple(range(11, 23)), tuple(range(60, 72))
"""Six blocks each (block size 2); in a pool of eight the second is handed four of the first's."""


def _slow_stores(h: Harness) -> None:
    """Each store first sleeps on its own stream: a busy copy engine, so the store reads late."""
    transfers = h.connector.worker.transfers
    chunks = transfers.store_chunks

    def store_chunks(*args: object, **kwargs: object) -> object:
        h.device.enqueue("store", "store", "copy engine busy", lambda: torch.cuda._sleep(DELAY))
        return chunks(*args, **kwargs)

    transfers.store_chunks = store_chunks  # type: ignore[method-assign]


def reuse_trial(mutant: str | None, aborted: bool) -> list[str]:
    """One trial: the violations found (empty: the bytes, outputs and invariants held)."""
    from kvfsm.executor.cuda import CudaDevice

    h = Harness(CudaDevice(), num_gpu_blocks=8, cpu_blocks=16, mutant=mutant)
    try:
        _slow_stores(h)
        first = h.add_request(FIRST, 4 if aborted else 1)
        h.engine.step()
        if aborted:
            h.abort(first)
        h.add_request(SECOND, 3)
        h.engine.step()
        found = h.violations()
        h.drain()
        return found + h.final_violations()
    finally:
        h.close()


@pytest.mark.parametrize("aborted", [False, True], ids=["finished", "aborted"])
def test_kvfsm_keeps_every_reuse_trial_intact(aborted: bool) -> None:
    bad = [found for _ in range(TRIALS) if (found := reuse_trial(None, aborted))]
    print(f"\nkvfsm ({'aborted' if aborted else 'finished'}): {len(bad)}/{TRIALS} trials with a violation")
    assert not bad, bad[0]


@pytest.mark.parametrize("aborted", [False, True], ids=["finished", "aborted"])
def test_control_without_the_lazy_fence_corrupts(aborted: bool) -> None:
    caught = [found for _ in range(TRIALS) if (found := reuse_trial("no-lazy-fence", aborted))]
    corrupt = [found for found in caught if any(line.startswith(("ready-means-written", "output", "fence"))
                                                for line in found)]
    print(f"\nno-lazy-fence ({'aborted' if aborted else 'finished'}): {len(caught)}/{TRIALS} trials caught, "
          f"{len(corrupt)} with corrupted bytes; e.g. {caught[0][:2] if caught else None}")
    assert corrupt, f"no-lazy-fence corrupted nothing in {TRIALS} trials"
