"""`python -m kvfsm.tp` with two gloo processes on SimDevices: one scheduler half on rank 0, a worker half and pinned
pool per rank. kvfsm serves the demo workload with every check holding while rank 1's copies fail now and then, and
while one rank's reports come steps late (rank skew); each tensor-parallel control of the scheduler half fails the
run, caught by its invariant: with skew and no failing rank where the control differs from kvfsm without a failure. Each run is a
subprocess with a time limit (the ranks meet through a file, so no port is taken)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvfsm import tp

SMALL = ["--conversations", "4", "--agents", "2", "--turns", "3"]
RUN_LIMIT_S = 300
"""A run that takes longer has hung (each takes seconds on an idle machine; collectives give up after 120 s)."""


def tp_run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "run.json"
    repo = str(Path(__file__).parents[1])  # the rank processes import this checkout's kvfsm
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "kvfsm.tp", "--device", "cpu", *SMALL, "--json", str(out), *args],
                          capture_output=True, text=True, timeout=RUN_LIMIT_S, env=env)
    assert out.exists(), done.stdout + done.stderr
    return done.returncode, json.loads(out.read_text())


def test_two_gloo_ranks_serve_with_every_check_holding_while_one_rank_fails_copies(tmp_path: Path) -> None:
    code, run = tp_run(tmp_path, "--failing-rank", "1")
    assert run["found"] == [] and code == 0
    assert run["ranks"] == 2 and run["blocks_loaded"] > 0 and run["cpu_hit_tokens"] > 0, "nothing was reloaded"
    assert run["loads_failed"] > 0, "rank 1 failed no load: the control of fail-everywhere below shows nothing"


@pytest.mark.parametrize("skewed", ["0", "1"])
def test_two_gloo_ranks_serve_with_every_check_holding_while_one_rank_reports_late(tmp_path: Path,
                                                                                   skewed: str) -> None:
    code, run = tp_run(tmp_path, "--skewed-rank", skewed)
    assert run["found"] == [] and code == 0
    assert run["blocks_loaded"] > 0 and run["cpu_hit_tokens"] > 0, "nothing was reloaded"


def test_skew_on_one_rank_and_failures_on_the_other_still_fail_each_such_job_everywhere(tmp_path: Path) -> None:
    code, run = tp_run(tmp_path, "--skewed-rank", "1", "--failing-rank", "0")
    assert run["found"] == [] and code == 0
    assert run["loads_failed"] > 0, "rank 0 failed no load: its failures were never reported before rank 1's success"


def test_control_completing_on_the_first_rank_report_is_caught_with_skew_and_no_failing_rank(tmp_path: Path) -> None:
    code, run = tp_run(tmp_path, "--control", "complete-on-first-report", "--skewed-rank", "1")
    assert code == 1 and any("every-rank-reports" in line for line in run["found"]), run["found"]


def test_control_completing_on_the_first_rank_report_is_caught_by_every_rank_reports(tmp_path: Path) -> None:
    code, run = tp_run(tmp_path, "--control", "complete-on-first-report")
    assert code == 1 and any("every-rank-reports" in line for line in run["found"]), run["found"]


@pytest.mark.parametrize("breaks", [["--failing-rank", "1"], ["--failing-rank", "0", "--skewed-rank", "1"]],
                         ids=["failure-reported-with-success", "failure-reported-before-success"])
def test_control_publishing_on_a_partial_failure_is_caught_by_fail_everywhere(tmp_path: Path,
                                                                               breaks: list[str]) -> None:
    """This control differs from kvfsm only when some rank's copy failed: it needs a failing rank, skew or not."""
    code, run = tp_run(tmp_path, "--control", "publish-on-partial-failure", *breaks)
    assert code == 1 and any("fail-everywhere" in line for line in run["found"]), run["found"]


@pytest.mark.parametrize(("args", "option"), [(["--skewed-rank", "2"], "--skewed-rank"),
                                              (["--skewed-rank", "1", "--skew-steps", "0"], "--skew-steps")])
def test_a_skew_the_ranks_cannot_have_is_refused_naming_the_option_before_any_run(args: list[str],
                                                                                  option: str) -> None:
    outcome = CliRunner().invoke(tp.app, ["--device", "cpu", *args])
    assert outcome.exit_code == 2 and option in outcome.output, outcome.output


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_on_two_gpus_serve_with_every_check_holding(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, "-m", "kvfsm.tp", "--device", "cuda", "--json", str(out)], check=False,
                   timeout=RUN_LIMIT_S)
    run = json.loads(out.read_text())
    assert run["found"] == [] and run["device"] == "cuda" and run["blocks_loaded"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_on_two_gpus_kvfsm_holds_and_the_first_report_control_is_caught_with_skew_and_no_failing_rank(
        tmp_path: Path) -> None:
    """Two GPUs end both ranks' copies in one step: only the skew makes `complete-on-first-report` differ."""
    runs = {}
    for name, control in (("kvfsm", []), ("control", ["--control", "complete-on-first-report"])):
        out = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, "-m", "kvfsm.tp", "--device", "cuda", "--skewed-rank", "1", "--json",
                        str(out), *control], check=False, timeout=RUN_LIMIT_S)
        runs[name] = json.loads(out.read_text())
    assert runs["kvfsm"]["found"] == [] and runs["kvfsm"]["blocks_loaded"] > 0
    assert any("every-rank-reports" in line for line in runs["control"]["found"]), runs["control"]["found"]
