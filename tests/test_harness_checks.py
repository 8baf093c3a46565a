"""The harness's two kinds of check each catch what the other cannot see.

A bug that corrupts bytes while every lifecycle moves correctly is invisible to the invariants (they read states
and the access log): the byte oracle must catch it. A bug that slips a state while every byte lands right is
invisible to the oracle: the invariants must catch it. Each test runs the same small workload with one such bug.
"""

from __future__ import annotations

from typing import Any

from kvfsm.executor.sim import SimDevice
from kvfsm.invariants import check_all
from kvfsm.testing.harness import Harness
from kvfsm.engine.oracle import expected_tokens

PROMPT = tuple(range(10, 22))
"""12 tokens: six 2-token GPU blocks, stored and then reloaded."""


def served(h: Harness) -> Harness:
    """Store the prompt's blocks, drop the GPU prefix cache, serve it again from CPU."""
    h.add_request(PROMPT, 1, "a")
    h.drain()
    h.engine.reset_prefix_cache()
    h.add_request(PROMPT, 2, "b")
    h.drain()
    return h


def test_bytes_wrong_with_every_state_right_is_caught_by_the_byte_oracle() -> None:
    h = Harness(SimDevice(), num_gpu_blocks=16, cpu_blocks=8)
    transfers, pool = h.faults, h.connector.worker.pool

    ordered: list[int] = []

    def store_chunks(gpu_blocks: Any, cpu_slots: Any) -> Any:
        ordered.extend(cpu_slots)
        return transfers.store_chunks(gpu_blocks, cpu_slots)

    def corrupting_merge(parts: Any) -> Any:
        """Control: the stores copy, then one byte of each slot they wrote flips; no state, no logged access
        changes."""
        chunks, slots = transfers.merge_chunks(parts), tuple(ordered)
        ordered.clear()
        enqueue = chunks.enqueue

        def flip() -> None:
            for slot in slots:
                pool.slot(slot)[0] ^= 0xFF

        def enqueue_then_flip(chunk: int, label: str) -> None:
            enqueue(chunk, label)
            if chunk == chunks.count - 1:
                h.device.enqueue("store", "store", f"flip after {label}", flip)

        chunks.enqueue = enqueue_then_flip
        return chunks

    h.connector.worker._transfers = type("Corrupting", (), {  # type: ignore[assignment]
        "store_chunks": staticmethod(store_chunks), "merge_chunks": staticmethod(corrupting_merge),
        "load": staticmethod(transfers.load)})()
    served(h)
    assert check_all(h.world) == {}, "the invariants see states and accesses only"
    assert h.violations(), "the byte oracle must see the flipped bytes"
    assert all(line.startswith("ready-means-written: CPU slot") for line in h.violations())


def test_a_state_slip_with_every_byte_right_is_caught_by_the_invariants() -> None:
    h = Harness(SimDevice(), num_gpu_blocks=16, cpu_blocks=8)
    tables = h.connector.scheduler.ledger._tables
    fire_fences = tables["gpu-block"]

    def forgets_to_unfence(trigger: str, block_ids: Any, **context: Any) -> None:
        """Control: a store's end leaves its GPU blocks fenced; nothing the engine reads or writes changes."""
        if trigger != "unfence":
            fire_fences(trigger, block_ids, **context)

    tables["gpu-block"] = forgets_to_unfence
    served(h)
    found = h.final_violations()
    assert h.engine.outputs() == {0: list(expected_tokens(PROMPT, 1, h.shape)),
                                  1: list(expected_tokens(PROMPT, 2, h.shape))}, "every byte and token is right"
    assert h.connector.scheduler.stats.blocks_loaded == 5, "the second request reloaded its prefix from CPU"
    assert not [line for line in found if line.startswith(("output:", "ready-means-written: CPU slot"))]
    assert "fence-count" in check_all(h.world)
