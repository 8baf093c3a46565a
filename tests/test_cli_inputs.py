"""The command lines (`kvfsm.demo`, `kvfsm.render`, `kvfsm.bench`) as a new user meets them: a bad option is refused
before any work, in one line naming the option, with typer's usage-error exit code 2 (never the integrity failure's
1); what a command promises in `--help` it does or says why not; and `--help` does not wait for torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from typer.testing import CliRunner, Result

from kvfsm import demo, render
from kvfsm.bench import __main__ as bench
from kvfsm.mooncake.local import free_loopback_port

SMALL_DEMO = ["--device", "cpu", "--conversations", "4", "--turns", "3", "--agents", "3", "--gpu-blocks", "32"]
STARTED = "without offloading"
"""The first run's progress label: seen only once the demo started serving."""
TORCH_PROBE = ("import runpy, sys\nsys.argv = ['{module}', '--help']\ntry:\n    runpy.run_module('{module}', "
               "run_name='__main__')\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)")
"""Runs `python -m MODULE --help` in a fresh interpreter, then says whether torch was imported."""


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    """A plain file: no folder can be made below it, even by root (which `os.access` lets write anywhere)."""
    path = tmp_path / "a-file"
    path.write_text("")
    return path


def one_line(outcome: Result) -> str:
    """The output with typer's error box and line wrapping undone, so a message reads as the one line it is."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", outcome.output).split())


def refused(app: typer.Typer, args: list[str], option: str) -> str:
    """Invoke `app`, check it was refused as a usage error naming `option`, and return the message."""
    outcome = CliRunner().invoke(app, args)
    message = one_line(outcome)
    assert outcome.exit_code == 2, outcome.output
    assert f"Invalid value for {option}" in message or f"Invalid value for '{option}'" in message, message
    return message


def torch_imported_by_help(module: str) -> bool:
    probe = subprocess.run([sys.executable, "-c", TORCH_PROBE.format(module=module)], capture_output=True, text=True,
                           check=True)
    return probe.stdout.strip().splitlines()[-1] == "True"


# --- the demo: every option checked before the run without offloading starts ------------------------------------


def test_demo_negative_disk_blocks_is_refused_naming_the_option_before_any_run(tmp_path: Path) -> None:
    message = refused(demo.app, [*SMALL_DEMO, "--disk", str(tmp_path), "--disk-blocks", "-1"], "'--disk-blocks'")
    assert STARTED not in message


def test_demo_mooncake_master_that_is_not_host_port_is_refused_naming_the_option() -> None:
    message = refused(demo.app, [*SMALL_DEMO, "--mooncake-master", "notahost"], "--mooncake-master")
    assert "'notahost'" in message and STARTED not in message


def test_demo_mooncake_master_nothing_listens_at_is_refused_naming_the_option() -> None:
    """Without Mooncake installed the refusal says so instead; either way it comes before the first run."""
    address = f"127.0.0.1:{free_loopback_port()}"
    message = refused(demo.app, [*SMALL_DEMO, "--mooncake-master", address], "--mooncake-master")
    assert f"nothing accepts connections at {address}" in message or "Mooncake is not installed" in message
    assert STARTED not in message


def test_demo_disk_folder_that_cannot_be_made_is_refused_naming_the_option(a_file: Path) -> None:
    message = refused(demo.app, [*SMALL_DEMO, "--disk", str(a_file / "disk")], "'--disk'")
    assert "is a file, not a folder" in message and STARTED not in message


def test_demo_unknown_writeback_is_refused_naming_the_option() -> None:
    refused(demo.app, [*SMALL_DEMO, "--writeback", "never"], "'--writeback'")


def test_demo_cpu_block_longer_than_every_request_is_refused_naming_the_option() -> None:
    """A CPU block is stored only once full: one longer than every request could never be, and the run would
    pass having checked no offloading."""
    message = refused(demo.app, [*SMALL_DEMO, "--block-size-factor", "1000"], "--block-size-factor")
    assert "nothing could ever be stored" in message and STARTED not in message


def test_demo_that_stored_nothing_passes_with_a_warning_naming_the_pool() -> None:
    """One CPU block may still store something (with a larger factor it does), so it is not refused; a run that
    stored nothing says so beside its PASS."""
    outcome = CliRunner().invoke(demo.app, [*SMALL_DEMO, "--cpu-blocks", "1"])
    assert outcome.exit_code == 0, outcome.output
    message = one_line(outcome)
    assert "PASS" in message and "kvfsm stored no block" in message and "--cpu-blocks 1" in message


def test_demo_that_stored_blocks_gives_no_such_warning() -> None:
    outcome = CliRunner().invoke(demo.app, SMALL_DEMO)
    assert outcome.exit_code == 0, outcome.output
    assert "stored no block" not in one_line(outcome)


@pytest.mark.parametrize("mutant", demo.SHOWN_BY_THE_WORKLOAD)
def test_every_control_the_help_says_the_default_workload_shows_fails_it(mutant: str) -> None:
    """`--help` names these as failing the default workload (`unpinned-load` among them, as `single-load`)."""
    assert mutant in one_line(CliRunner().invoke(demo.app, ["--help"]))
    outcome = CliRunner().invoke(demo.app, ["--device", "cpu", "--mutant", mutant])
    assert outcome.exit_code == 1, outcome.output
    assert "FAIL" in outcome.output


# --- every command: a value typer refuses, named ----------------------------------------------------------------


@pytest.mark.parametrize(("app", "args", "option"), [
    (demo.app, ["--gpu-blocks", "0"], "--gpu-blocks"),
    (demo.app, ["--block-size-factor", "-1"], "--block-size-factor"),
    (demo.app, ["--turns", "0"], "--turns"),
    (demo.app, ["--eviction", "fifo"], "--eviction"),
    (render.app, ["--spec", "no-such-folder", "--out", "x"], "--spec"),
    (bench.app, ["--out", __file__], "--out"),
])
def test_an_illegal_command_line_option_is_refused_naming_it(app: typer.Typer, args: list[str], option: str) -> None:
    """typer refuses the value (exit 2) and names the option, before any work starts."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert option in result.output


def test_render_docs_outside_a_checkout_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(render.cli, "DOCS_DIR", tmp_path / "site-packages" / "docs")
    result = CliRunner().invoke(render.app, ["--docs"])
    assert result.exit_code == 2 and "--docs" in result.output and "source checkout" in result.output
    assert not (tmp_path / "site-packages").exists()


# --- render and bench: the folder they write into is checked before the work ------------------------------------


def test_render_out_folder_that_cannot_be_made_is_refused_naming_the_option(a_file: Path) -> None:
    message = refused(render.app, ["--out", str(a_file / "out")], "'--out'")
    assert "is a file, not a folder" in message and "wrote" not in message


def test_bench_out_folder_that_cannot_be_made_is_refused_before_measuring(
        a_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    monkeypatch.setitem(bench.RUNNERS, "scheduler", lambda result, quick: ran.append("scheduler"))
    for args in (["--out", str(a_file / "out"), "scheduler"], ["scheduler", "--out", str(a_file / "out")]):
        message = refused(bench.app, [*args, "--quick"], "'--out'")
        assert "is a file, not a folder" in message
    assert ran == []


def test_bench_out_and_quick_given_before_a_part_are_honoured(tmp_path: Path, no_cuda: None) -> None:
    outcome = CliRunner().invoke(bench.app, ["--out", str(tmp_path), "--quick", "scheduler"])
    assert outcome.exit_code == 0, outcome.output
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["quick"] and "scheduler" in result


def test_bench_out_given_both_before_and_after_a_part_is_refused(tmp_path: Path) -> None:
    message = refused(bench.app, ["--out", str(tmp_path / "a"), "scheduler", "--out", str(tmp_path / "b")], "--out")
    assert "given twice" in message


def test_bench_vllm_refuses_an_unknown_comparison_naming_the_known_ones(tmp_path: Path) -> None:
    message = refused(bench.app, ["vllm", "--only", "tiers", "--only", "nope", "--out", str(tmp_path)], "--only")
    assert "unknown: nope; known: workloads, inline, tiers" in message


def test_bench_without_a_gpu_says_on_the_console_why_it_drew_no_png(tmp_path: Path, no_cuda: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench.RUNNERS, "scheduler", lambda result, quick: None)
    outcome = CliRunner().invoke(bench.app, ["scheduler", "--out", str(tmp_path)])
    assert outcome.exit_code == 0, outcome.output
    assert "no bench.png: no GPU measurement to plot" in one_line(outcome)
    assert not (tmp_path / "bench.png").exists()


def test_bench_without_matplotlib_says_on_the_console_why_it_drew_no_png(tmp_path: Path, no_cuda: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU figure to draw (planted: there is no GPU here) and no matplotlib: the console says which is missing,
    as `--help` warns."""
    def ttft_measured(result: dict[str, Any], quick: bool) -> None:
        result["ttft"] = {"num_layers": 1, "h2d_gbps": 1.0, "rows": []}

    monkeypatch.setitem(bench.RUNNERS, "scheduler", ttft_measured)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    outcome = CliRunner().invoke(bench.app, ["scheduler", "--out", str(tmp_path)])
    assert outcome.exit_code == 0, outcome.output
    assert "no bench.png: matplotlib is not installed" in one_line(outcome)
    assert "matplotlib is installed" in one_line(CliRunner().invoke(bench.app, ["--help"]))


# --- --help does not wait for torch ------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["kvfsm.demo", "kvfsm.render", "kvfsm.bench"])
def test_help_imports_no_torch(module: str) -> None:
    """torch took most of `--help`'s seconds; the commands import it once their options are parsed."""
    assert not torch_imported_by_help(module)


def test_control_the_torch_probe_sees_a_command_that_imports_torch() -> None:
    """`kvfsm.tp` imports torch at the top: the probe must report it, or the test above could never fail."""
    assert torch_imported_by_help("kvfsm.tp")
