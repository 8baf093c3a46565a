"""checksum: a CPU block whose bytes changed after its store completed is never loaded; the engine recomputes."""

from __future__ import annotations

import pytest

from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import Harness
from kvfsm.testing.oracle import expected_tokens

PREFIX = (11, 12, 13, 14, 15, 16)


def corrupted_reload(checksum: bool) -> tuple[Harness, dict[int, list[int]]]:
    """Store a prefix, flip a bit in its first CPU block, then make a second request reload it."""
    harness = Harness(SimDevice(), num_gpu_blocks=12, cpu_blocks=8, checksum=checksum)
    harness.add_request(PREFIX + (1,), 1)
    harness.drain()
    slot = harness.connector.scheduler.manager.catalogue[harness.engine.finished[0].block_hashes[0]]
    harness.connector.worker.pool.slot(slot)[0] ^= 0x40  # a stray write to pinned host memory
    harness.engine.reset_prefix_cache()
    harness.add_request(PREFIX + (2,), 2)
    harness.drain()
    return harness, harness.engine.outputs()


def test_a_changed_cpu_block_fails_its_load_and_is_recomputed(caplog: pytest.LogCaptureFixture) -> None:
    harness, outputs = corrupted_reload(checksum=True)
    assert harness.connector.scheduler.stats.loads_failed == 1
    assert "changed since its store completed" in caplog.text
    assert outputs[1] == list(expected_tokens(PREFIX + (2,), 2, harness.shape))


def test_control_without_checksum_the_changed_block_is_loaded() -> None:
    harness, outputs = corrupted_reload(checksum=False)
    assert harness.connector.scheduler.stats.loads_failed == 0
    assert outputs[1] != list(expected_tokens(PREFIX + (2,), 2, harness.shape))
