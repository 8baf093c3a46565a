"""`python -m kvfsm.bench policies`: every eviction policy and admission setting replayed over the synthetic traces,
and the goal judged on them (seed by seed, against ARC storing every block).

Apart from `test_bench.py` (the connector, engine and TTFT parts) because this part replays traces through the
manager alone and judges a goal of its own. Performance is reported, never asserted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfsm.bench import policies, traces
from kvfsm.bench.__main__ import app


@pytest.fixture
def small_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(policies.REQUESTS, True, 200)


def test_policies_replays_every_trace_for_every_policy_and_admission_writing_json_and_png(
        tmp_path: Path, small_traces: None) -> None:
    run = CliRunner().invoke(app, ["policies", "--quick", "--out", str(tmp_path)])
    assert run.exit_code == 0, run.output
    result = json.loads((tmp_path / "policies.json").read_text())
    (only,) = result["runs"]
    cells = {(r["trace"], r["policy"], r["admission"]) for r in only["rows"]}
    assert cells == {(t, p, a) for t in traces.TRACES for p in policies.POLICIES for a in policies.ADMISSIONS}
    assert all(0 <= r["hit_rate"] <= 1 and r["tokens_served_from_cpu"] >= 0 for r in only["rows"])
    assert result["plot"] == "policies.png" and (tmp_path / "policies.png").exists()
    assert "goal (beats ARC (every block) on >= 3 of 4 traces" in " ".join(run.output.split())


def test_policies_judges_the_goal_seed_by_seed_with_seeds(tmp_path: Path, small_traces: None) -> None:
    run = CliRunner().invoke(app, ["policies", "--quick", "--seed", "3", "--seeds", "2", "--out", str(tmp_path)])
    assert run.exit_code == 0, run.output
    result = json.loads((tmp_path / "policies.json").read_text())
    assert result["seeds"] == [3, 4] and [one["seed"] for one in result["runs"]] == [3, 4]
    assert set(result["goal"]["met_on"]) == set(result["runs"][0]["goal"]["settings"])
    assert "The goal per seed (3, 4, quick)" in " ".join(run.output.split())


def test_policies_replays_only_the_settings_asked_beside_the_baseline(tmp_path: Path, small_traces: None) -> None:
    run = CliRunner().invoke(app, ["policies", "--quick", "--setting", "s3-fifo:cold-threshold-2", "--out",
                                   str(tmp_path)])
    assert run.exit_code == 0, run.output
    (only,) = json.loads((tmp_path / "policies.json").read_text())["runs"]
    assert {(r["policy"], r["admission"]) for r in only["rows"]} == {policies.BASELINE, ("s3-fifo", "cold-threshold-2")}
    assert list(only["goal"]["settings"]) == ["s3-fifo, cold-threshold-2"]


@pytest.mark.parametrize(("option", "value"), [("--seeds", "0"), ("--setting", "s3-fifo:every-other-block"),
                                               ("--setting", "fifo:every-block")])
def test_policies_refuses_a_bad_option_before_any_work(tmp_path: Path, option: str, value: str) -> None:
    run = CliRunner().invoke(app, ["policies", option, value, "--out", str(tmp_path)])
    assert run.exit_code == 2 and option in run.output and not (tmp_path / "policies.json").exists()


def test_policies_without_matplotlib_says_on_the_console_why_it_drew_no_png(
        tmp_path: Path, small_traces: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run = CliRunner().invoke(app, ["policies", "--quick", "--out", str(tmp_path)])
    assert run.exit_code == 0, run.output
    assert "no policies.png: matplotlib is not installed" in " ".join(run.output.split())


@pytest.mark.parametrize("make", sorted(traces.TRACES))
def test_a_trace_is_the_same_for_the_same_seed_and_another_for_another(make: str) -> None:
    generate = traces.TRACES[make]
    assert generate(1, 50) == generate(1, 50) and generate(1, 50) != generate(2, 50)


def _rows(deltas: dict[str, float], scan_bytes: float = 0.5) -> list[dict[str, object]]:
    """ARC storing every block at 50% on every trace, 1.0 byte per token; s3-fifo `deltas` points off, `scan_bytes`."""
    arc = [{"trace": t, "policy": "arc", "admission": "every-block", "hit_rate": 0.5,
            "bytes_stored_per_token_served": 1.0} for t in deltas]
    return arc + [{"trace": t, "policy": "s3-fifo", "admission": "every-block", "hit_rate": 0.5 + d / 100,
                   "bytes_stored_per_token_served": scan_bytes if t == "scans" else 1.0} for t, d in deltas.items()]


def test_the_goal_is_met_by_beating_arc_on_three_traces_and_losing_at_most_two_points_on_the_fourth() -> None:
    met = ["s3-fifo, every-block"]
    assert policies.judge(_rows({"chat": 0.5, "agents": 0.5, "zipf": 0.5, "scans": -2.0}))["met_by"] == met
    assert policies.judge(_rows({"chat": 0.5, "agents": 0.5, "zipf": 0.5, "scans": -2.1}))["met_by"] == []
    assert policies.judge(_rows({"chat": 0.5, "agents": 0.5, "zipf": 0.0, "scans": 0.0}))["met_by"] == []


def _run(seed: int, met: bool) -> dict[str, object]:
    return {"seed": seed, "goal": {"target": "t", "settings": {"s3-fifo, every-block": {"met": met}}}}


def test_across_seeds_a_setting_meets_the_goal_only_if_it_does_on_every_seed() -> None:
    assert policies.across([_run(0, True), _run(1, True)])["met_by"] == ["s3-fifo, every-block"]
    failed = policies.across([_run(0, True), _run(1, False)])
    assert failed["met_by"] == [] and failed["met_on"] == {"s3-fifo, every-block": [0]}


def test_the_goal_needs_thirty_percent_fewer_bytes_per_token_served_on_the_scan_trace() -> None:
    deltas = {"chat": 0.5, "agents": 0.5, "zipf": 0.5, "scans": 0.5}
    assert policies.judge(_rows(deltas, scan_bytes=0.7))["met_by"] == ["s3-fifo, every-block"]
    assert policies.judge(_rows(deltas, scan_bytes=0.71))["met_by"] == []
