"""`python -m kvfsm.bench mooncake`: each way of moving the bytes is measured, verified, and beside its baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("mooncake.store")

from kvfsm.bench.__main__ import app  # noqa: E402

WAYS = {"baseline put", "baseline get", "zero-copy put", "zero-copy get", "tier write-back", "tier fetch",
        "MACs alone"}


def test_the_mooncake_part_reports_every_way_for_both_placements_with_the_mac_threads_and_blocks_asked(
        tmp_path: Path) -> None:
    run = CliRunner().invoke(app, ["mooncake", "--out", str(tmp_path), "--quick", "--hash-threads", "3",
                                   "--blocks", "3"])
    assert run.exit_code == 0, run.output
    rows = json.loads((tmp_path / "bench.json").read_text())["mooncake"]
    assert [(row["segment"], row["hash_threads"], row["blocks"], row["bytes_per_rep"]) for row in rows] == [
        ("segment host", 3, 3, 3 * (256 << 10)), ("own", 3, 3, 3 * (256 << 10))]
    for row in rows:
        assert set(row["gbps"]) == WAYS and all(v > 0 for v in row["gbps"].values())
        assert row["fetch_share_of_baseline"] > 0 and row["write_back_share_of_baseline"] > 0
    assert "Mooncake tier, GB/s" in run.output
