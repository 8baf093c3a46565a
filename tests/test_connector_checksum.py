"""checksum: a CPU block whose bytes changed after its store completed is never loaded; the engine recomputes."""

from __future__ import annotations

import pytest

from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import Harness
from kvfsm.engine.oracle import expected_tokens

PREFIX = (11, 12, 13, 14, 15, 16)


def reload(checksum: bool, corrupt: bool = True) -> tuple[Harness, dict[int, list[int]], int]:
    """Store a prefix, flip a bit in its first CPU block (unless not `corrupt`), then make a second request reload
    it; the harness, the outputs and the flipped slot."""
    harness = Harness(SimDevice(), num_gpu_blocks=12, cpu_blocks=8, checksum=checksum)
    harness.add_request(PREFIX + (1,), 1)
    harness.drain()
    slot = harness.connector.scheduler.manager.catalogue[harness.engine.finished[0].block_hashes[0]]
    if corrupt:
        harness.connector.worker.pool.slot(slot)[0] ^= 0x40  # a stray write to pinned host memory
    harness.engine.reset_prefix_cache()
    harness.add_request(PREFIX + (2,), 2)
    harness.drain()
    return harness, harness.engine.outputs(), slot


def test_a_changed_cpu_block_fails_its_load_naming_the_slot_and_is_recomputed(
        caplog: pytest.LogCaptureFixture) -> None:
    harness, outputs, slot = reload(checksum=True)
    assert harness.connector.scheduler.stats.loads_failed == 1
    assert f"CPU slot {slot} changed since its store completed; its load fails" in caplog.messages
    assert f"ChecksumMismatch: CPU slot {slot} changed since its store completed" in caplog.text
    assert outputs[1] == list(expected_tokens(PREFIX + (2,), 2, harness.shape))


def test_an_unchanged_cpu_block_loads_with_checksums_on() -> None:
    harness, outputs, _ = reload(checksum=True, corrupt=False)
    stats = harness.connector.scheduler.stats
    assert (stats.loads_failed, stats.blocks_loaded) == (0, 3)
    assert outputs[1] == list(expected_tokens(PREFIX + (2,), 2, harness.shape))


def test_control_without_checksum_the_changed_block_is_loaded() -> None:
    harness, outputs, _ = reload(checksum=False)
    assert harness.connector.scheduler.stats.loads_failed == 0
    assert outputs[1] != list(expected_tokens(PREFIX + (2,), 2, harness.shape))
