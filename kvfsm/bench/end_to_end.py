"""The connector end to end, a row per layout and block size: the same moves timed three ways, as shares of the
ceilings measured in the same run.

- At the step's end (`connector.ConnectorRounds`): one engine step by itself, reported once every job ended: its
  bookkeeping before the first copy and after the last lies on the copies' path, with nothing to overlap it.
- As jobs finish (`_as_finished`): the same step, reported by an engine that steps while the copies run.
- Sustained (`_sustained`, `sustained.SustainedSteps`): many steps back to back, each ordering a region's moves
  while earlier steps' copies still run: whether the connector keeps the copy engines fed under load. The
  bench's share goals are judged on this reading.

One step by itself is also reported as its fixed cost (`_fixed_ms`): its time less its bytes at the ceiling.
"""

from __future__ import annotations

import statistics
from typing import Callable

from kvfsm.bench.connector import ConnectorRounds
from kvfsm.bench.sustained import ROTATION, SustainedSteps, pool_blocks
from kvfsm.executor.device import Device

LLAMA_8B_KV = {"num_layers": 32, "num_heads": 8, "head_dim": 128}
SUSTAINED_STEPS = 8
"""Steps of one sustained run: enough that its first step's head and its last step's tail are a small part of it."""


def _median(fn: Callable[[], float], reps: int) -> float:
    fn()  # warm-up: staging slots, index buffers, first use of every machine path
    return statistics.median(fn() for _ in range(reps))


def _ways(moved: int, store_s: float, load_s: float,
          both_s: float) -> tuple[tuple[str, float, int, str], ...]:
    """Each way a step moves bytes: its name, seconds, bytes, and the ceiling (a key of the peaks) it is a share of."""
    return (("store", store_s, moved, "d2h"), ("load", load_s, moved, "h2d"), ("both", both_s, 2 * moved, "both"))


def _shares(row: dict[str, float | int | str], suffix: str, moved: int, peaks: dict[str, float],
            store_s: float, load_s: float, both_s: float) -> None:
    for kind, seconds, nbytes, peak in _ways(moved, store_s, load_s, both_s):
        gbps = nbytes / seconds / 1e9
        row.update({f"{kind}_gbps{suffix}": gbps, f"{kind}_share{suffix}": gbps / peaks[peak]})


def _fixed_ms(row: dict[str, float | int | str], moved: int, peaks: dict[str, float],
              store_s: float, load_s: float, both_s: float) -> None:
    """What one step by itself costs beyond its bytes at the ceiling, in ms: the engine's wait for a step's
    bookkeeping and submission before its first copy and its completion after the last, which a share of one
    step folds into bandwidth."""
    for kind, seconds, nbytes, peak in _ways(moved, store_s, load_s, both_s):
        row[f"{kind}_fixed_ms"] = (seconds - nbytes / peaks[peak] / 1e9) * 1e3


def run(device: Device, layout: str, block_tokens: int, peaks: dict[str, float], moved_bytes: int = 1 << 30,
        prompt_tokens: int = 2048, reps: int = 5, shape: dict[str, int] = LLAMA_8B_KV) -> dict[str, float | int | str]:
    """Store, load and both-ways GB/s through the connector, `moved_bytes` each way a step, each as a share of
    the ceiling of the same run: at the step's end, as jobs finish, and sustained over `SUSTAINED_STEPS` steps.
    The cache is `shape` (layers, KV heads, head dim) in bf16."""
    block_bytes = 2 * shape["num_layers"] * block_tokens * shape["num_heads"] * shape["head_dim"] * 2
    prompt_blocks = max(1, prompt_tokens // block_tokens)
    region = max(prompt_blocks, moved_bytes // block_bytes // prompt_blocks * prompt_blocks)
    regions = 2 * ROTATION
    rounds = ConnectorRounds(device, layout, block_tokens, regions * region, prompt_blocks, regions=regions,
                             cpu_blocks=pool_blocks(region), **shape)
    row: dict[str, float | int | str] = {"layout": layout, "block_tokens": block_tokens}
    try:
        moved = rounds.bytes_per_region
        for suffix, as_finished in (("", False), ("_as_finished", True)):
            rounds.as_finished = as_finished
            store_s = _median(rounds.store, reps)
            load_s = _median(rounds.load, reps)
            rounds.check_landed()
            both_s = _median(rounds.both, reps)
            _shares(row, suffix, moved, peaks, store_s, load_s, both_s)
            if not as_finished:
                _fixed_ms(row, moved, peaks, store_s, load_s, both_s)
        sustained = SustainedSteps(rounds)
        store_s = _median(lambda: sustained.store(SUSTAINED_STEPS), reps)
        load_s = _median(lambda: sustained.load(SUSTAINED_STEPS), reps)
        sustained.check_landed()
        both_s = _median(lambda: sustained.both(SUSTAINED_STEPS), reps)
        sustained.check_landed()
        _shares(row, "_sustained", SUSTAINED_STEPS * moved, peaks, store_s, load_s, both_s)
        row.update(mechanism=rounds.connector.worker.transfers.mechanism, bytes_each_way=moved)
    finally:
        rounds.close()
        del rounds
    return row
