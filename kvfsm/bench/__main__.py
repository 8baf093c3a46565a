"""`python -m kvfsm.bench`: every kvfsm benchmark in one process, each figure beside the ceiling of the same run.

The bare command runs all parts; a subcommand runs one. Without CUDA only the CPU-side parts run and the rest are
listed as skipped (exit status 0). Results go to `--out` (given before or after the part's name): `bench.json`
(everything, with the goals and whether each was met) and, when the connector or ttft part ran (they need CUDA)
and matplotlib is installed, `bench.png`; the console says why when it is not drawn. Performance is reported
here, never asserted.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, Mapping

import typer

from kvfsm.bench import plot
from kvfsm.bench.goals import verdicts
from kvfsm.bench.parts import GPU_PARTS, PARTS, RUNNERS, Runner
from kvfsm.bench.report import console, show
from kvfsm.mooncake import available as mooncake_available
from kvfsm.options import folder_option

app = typer.Typer(add_completion=False, help=__doc__)


def collect(parts: tuple[str, ...], out: Path, quick: bool, runners: Mapping[str, Runner] = RUNNERS
            ) -> dict[str, Any]:
    """Run `parts` in order (each by its runner in `runners`), write `bench.json` and `bench.png` (or why not) into
    `out`, print the tables; returns the result."""
    import torch

    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                              "quick": quick, "skipped": [p for p in parts if p in GPU_PARTS and not cuda]
                              + [p for p in parts if p == "mooncake" and not mooncake_available()]}
    errors: dict[str, str] = {}
    for part in parts:
        if part in result["skipped"]:
            continue
        try:
            runners[part](result, quick)
        except Exception as error:  # one broken part must not lose the others' figures; the exit status says it
            errors[part] = f"{type(error).__name__}: {error}"
            console.print_exception()
    result["errors"] = errors
    result["verdicts"] = verdicts(result)
    out.mkdir(parents=True, exist_ok=True)
    not_drawn = plot.save(result, out / "bench.png")
    result["plot"] = not_drawn or "bench.png"
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    show(result)
    console.print(f"wrote {out / 'bench.json'}")
    console.print(f"wrote {out / 'bench.png'}" if not_drawn is None else f"[yellow]no bench.png[/yellow]: {not_drawn}")
    return result


DEFAULT_OUT = Path("bench-out")
OUT = folder_option(None, "--out", help=f"directory for bench.json and bench.png (default {DEFAULT_OUT}; a part's "
                                        "--out defaults to the one given before its name)", show_default=False)
QUICK = typer.Option(False, "--quick", help="small sizes: checks the plumbing, not the hardware")


def _exit(result: dict[str, Any]) -> None:
    if result["errors"]:
        raise typer.Exit(1)


@app.callback(invoke_without_command=True)
def everything(ctx: typer.Context, out: Path | None = OUT, quick: bool = QUICK) -> None:
    """Run every part (the bare command)."""
    if ctx.invoked_subcommand is None:
        _exit(collect(PARTS, out or DEFAULT_OUT, quick))


def _settings(ctx: typer.Context, out: Path | None, quick: bool) -> tuple[Path, bool]:
    """A part's `--out` and `--quick`, or those given before its name (`bench --out X scheduler`); one folder
    given both before and after the name is ambiguous, and refused."""
    assert ctx.parent is not None  # a part is always a subcommand of the bare command
    before: Path | None = ctx.parent.params["out"]
    if out is not None and before is not None and out != before:
        raise typer.BadParameter(f"given twice: {before} before the part's name, {out} after it", ctx=ctx,
                                 param_hint="--out")
    return out or before or DEFAULT_OUT, quick or ctx.parent.params["quick"]


def _one(part: str) -> None:
    def command(ctx: typer.Context, out: Path | None = OUT, quick: bool = QUICK) -> None:
        _exit(collect((part,), *_settings(ctx, out, quick)))

    command.__doc__ = f"Run only the {part} part."
    app.command(part)(command)


for _part in PARTS:
    if _part != "mooncake":  # its command takes options of its own, below
        _one(_part)


@app.command("mooncake")
def mooncake_part(ctx: typer.Context, out: Path | None = OUT, quick: bool = QUICK,
                  hash_threads: list[int] = typer.Option([], min=1, help="the tier client's MAC threads "
                                                                          "(repeatable: one row per count, each with "
                                                                          "its own baselines; default: the client's "
                                                                          "default, half the cores, 2 to 8)"),
                  blocks: int | None = typer.Option(None, min=1, help="blocks one call moves (default 128 of 2 MiB, "
                                                                     "8 of 256 KiB with --quick)")
                  ) -> None:
    """Run only the mooncake part."""
    chosen: tuple[int | None, ...] = tuple(hash_threads) or (None,)
    runners = {**RUNNERS, "mooncake": partial(RUNNERS["mooncake"], hash_threads=chosen, blocks=blocks)}
    _exit(collect(("mooncake",), *_settings(ctx, out, quick), runners))


VLLM_PARTS = ("workloads", "inline", "tiers", "hybrid")
"""The `vllm` command's comparisons: the connectors over the workloads, `layer_loads` inline, the tiered workload,
the hybrid (full + sliding-window) workload."""


@app.command("vllm")
def vllm_side_by_side(ctx: typer.Context, out: Path | None = OUT, quick: bool = QUICK,
                      only: list[str] = typer.Option([], help=f"only this comparison (repeatable): one of "
                                                             f"{', '.join(VLLM_PARTS)}"),
                      step_ms: float | None = typer.Option(None, min=0.0, help="the tiered workload's model step, in "
                                                                              "ms of wall time between steps, the "
                                                                              "same for both connectors (default: "
                                                                              "bench_tiers.STEP_MS)")
                      ) -> None:
    """kvfsm's vLLM connector beside vLLM's OffloadingConnector under vLLM's Scheduler (needs vLLM 0.32)."""
    unknown = sorted(set(only) - set(VLLM_PARTS))
    if unknown:
        raise typer.BadParameter(f"unknown: {', '.join(unknown)}; known: {', '.join(VLLM_PARTS)}", ctx=ctx,
                                 param_hint="--only")
    try:
        from kvfsm.integrations.vllm import bench as vllm_bench
        from kvfsm.integrations.vllm import bench_hybrid, bench_inline, bench_tiers
    except ImportError as missing:
        console.print(f"vllm: skipped ({missing}); run it in the venv with vLLM 0.32")
        return
    chosen = only or VLLM_PARTS
    if "workloads" in chosen:
        vllm_bench.main(*_settings(ctx, out, quick))
    if "inline" in chosen:
        bench_inline.main(*_settings(ctx, out, quick))
    if "tiers" in chosen:
        bench_tiers.main(*_settings(ctx, out, quick), bench_tiers.STEP_MS if step_ms is None else step_ms)
    if "hybrid" in chosen:
        bench_hybrid.main(*_settings(ctx, out, quick))


@app.command("policies")
def policy_comparison(ctx: typer.Context, out: Path | None = OUT, quick: bool = QUICK,
                      seed: int = typer.Option(0, min=0, help="seed of the four traces (the first, with --seeds)"),
                      seeds: int = typer.Option(1, min=1, help="how many seeds, from --seed on; the goal must hold "
                                                                 "on each"),
                      setting: list[str] = typer.Option([], help="only this policy:admission (repeatable; ARC "
                                                                 "storing every block, the baseline, always runs)")
                      ) -> None:
    """Every eviction policy and admission setting over four synthetic traces: hit rate, tokens served from CPU,
    bytes stored per token served (policies.json, policies.png), and the goal judged seed by seed."""
    from kvfsm.bench import policies

    try:
        chosen = [policies.parse_setting(text) for text in setting] or policies.EVERY_SETTING
    except ValueError as bad:
        raise typer.BadParameter(str(bad), ctx=ctx, param_hint="--setting") from bad
    policies.main(*_settings(ctx, out, quick), console, range(seed, seed + seeds), chosen)


if __name__ == "__main__":
    app()
