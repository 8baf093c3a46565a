"""`python -m kvfsm.tp` with two gloo processes on SimDevices: one scheduler half on rank 0, a worker half and pinned
pool per rank. kvfsm serves the demo workload with every check holding while rank 1's copies fail now and then;
each tensor-parallel control of the scheduler half fails the run, caught by its invariant. Each run is a
subprocess with a time limit (the ranks meet through a file, so no port is taken)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_control_completing_on_the_first_rank_report_is_caught_by_every_rank_reports(tmp_path: Path) -> None:
    code, run = tp_run(tmp_path, "--control", "complete-on-first-report")
    assert code == 1 and any("every-rank-reports" in line for line in run["found"]), run["found"]


def test_control_publishing_on_a_partial_failure_is_caught_by_fail_everywhere(tmp_path: Path) -> None:
    code, run = tp_run(tmp_path, "--control", "publish-on-partial-failure", "--failing-rank", "1")
    assert code == 1 and any("fail-everywhere" in line for line in run["found"]), run["found"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_on_two_gpus_serve_with_every_check_holding(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, "-m", "kvfsm.tp", "--device", "cuda", "--json", str(out)], check=False,
                   timeout=RUN_LIMIT_S)
    run = json.loads(out.read_text())
    assert run["found"] == [] and run["device"] == "cuda" and run["blocks_loaded"] > 0
