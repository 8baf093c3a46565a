"""The Mooncake bench under other cuts of a fetch: how fast its runs shrink, how long its last run is, how many MAC
threads check them.

A fetch gets its values in runs that shrink toward its end (`kvfsm.mooncake.pipeline.fetch_runs`), so the checks of
each run hide behind the next get and only the last run's checks follow the last byte. How fast they may shrink
depends on how fast the MAC threads check beside a transfer against how fast the store gets (`CHECK_OVER_GET`); this
sets that constant (and optionally the last run's length and the thread count) per variant, runs the bench's
`kvfsm.bench.mooncake.run` for both placements, rotating the variants' order each repetition, and prints each
reading and then each variant's range (docs/mooncake.md, session 26).

Usage (where Mooncake is installed; a GPU host for figures worth quoting):
`python tools/probes/mooncake_fetch_cuts.py BLOCKS REPETITIONS VARIANT...`, variants named in `VARIANTS`.
"""

from __future__ import annotations

import sys
from typing import Sequence

from kvfsm.bench import mooncake as bench
from kvfsm.mooncake import pipeline

VARIANTS = {"check2": (2, 0, 8), "check4": (4, 0, 8), "check4-last4": (4, 4, 8), "check8": (8, 0, 8),
            "check4-threads12": (4, 0, 12)}
"""Name: (`CHECK_OVER_GET`, the last run's values or 0 for the client's own rule, MAC threads)."""
PLACEMENTS = ("segment host", "own")
ROUND_VALUES = pipeline.round_values
"""The client's own rule for the last run's length."""


def use(variant: str) -> int:
    """Set `variant`'s cut for the fetches that follow; its MAC threads."""
    check_over_get, last, threads = VARIANTS[variant]
    pipeline.CHECK_OVER_GET = check_over_get
    pipeline.round_values = (lambda sizes, hash_threads, pipeline_bytes: last) if last else ROUND_VALUES
    return threads


def main(blocks: int, repetitions: int, variants: Sequence[str]) -> None:
    readings: list[tuple[str, str, float, float]] = []
    for rep in range(repetitions):
        turn = rep % len(variants)
        for variant in list(variants[turn:]) + list(variants[:turn]):
            threads = use(variant)
            for placement in PLACEMENTS:
                result = bench.run(False, placement, threads, blocks)
                readings.append((variant, placement, result["write_back_share_of_zero_copy"],
                                 result["fetch_share_of_zero_copy"]))
                print(f"{blocks} blocks {variant:16s} {placement:12s} write-back {readings[-1][2]:.2f} "
                      f"fetch {readings[-1][3]:.2f}", flush=True)
    for variant in variants:
        for placement in PLACEMENTS:
            mine = [r for r in readings if r[0] == variant and r[1] == placement]
            write_backs, fetches = [r[2] for r in mine], [r[3] for r in mine]
            print(f"{blocks} blocks {variant:16s} {placement:12s} write-back {min(write_backs):.2f}-"
                  f"{max(write_backs):.2f} fetch {min(fetches):.2f}-{max(fetches):.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
