"""A long run over a disk tier whose writes fail and a Mooncake tier whose master is killed and restarted: with
`keep_history=False` no bookkeeping structure the connector keeps outgrows the bound its configuration sets, and each
control that puts one kind of growth back (history kept, fetch origins keyed by hash, the Mooncake index unbounded) is
caught, the check naming what grew (`kvfsm.testing.tier_soak`; `python -m kvfsm.testing.tier_soak` for longer runs).

One soak serves every test of this module: the engines run in lockstep on one deployment, so its one outage (a
killed master costs seconds) is shared."""

from __future__ import annotations

import logging
from typing import Iterator

import pytest

pytest.importorskip("mooncake.store")

from kvfsm.mooncake.local import LocalMooncake  # noqa: E402
from kvfsm.testing.tier_soak import CONTROLS, SoakReport, SoakShape, controlled_harness, soak  # noqa: E402

SHAPE = SoakShape()


@pytest.fixture(scope="module")
def soaked(mooncake: LocalMooncake) -> Iterator[dict[str, SoakReport]]:
    """The production engine's report (under "production") and each control's (under its name)."""
    engines = {name: controlled_harness(str(mooncake.address), SHAPE, control)
               for name, control in [("production", None), *((c, c) for c in CONTROLS)]}
    logger = logging.getLogger("kvfsm")
    level = logger.level
    logger.setLevel(logging.ERROR)  # every failed write warns
    try:
        yield soak(engines, mooncake, SHAPE)
    finally:
        logger.setLevel(level)
        for h in engines.values():
            h.close()


def test_without_history_no_structure_outgrows_the_bound_over_failing_tiers(soaked) -> None:
    report = soaked["production"]
    assert report.outgrown == {}
    assert {"full", "io-error"} <= set(report.failures), "the soak must fail disk writes and store calls"


@pytest.mark.parametrize(("control", "growing"), [
    ("history-kept", {"Ledger.jobs", "Ledger.tier_jobs", "Ledger.requests", "Ledger.reported_failed"}),
    ("origins-by-hash", {"TierPlanner._origin"}),
    ("index-unbounded", {"TierEntries[mooncake].by_key"}),
])
def test_the_soak_catches_a_control_that_keeps_what_it_is_done_with(soaked, control: str, growing: set[str]) -> None:
    outgrown = soaked[control].outgrown
    assert growing <= set(outgrown), f"{control}: outgrew {sorted(outgrown)}"
