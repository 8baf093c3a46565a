"""`python -m kvfsm.bench`: every kvfsm benchmark in one process, each figure beside the ceiling of the same run.

The bare command runs all parts; a subcommand runs one. Without CUDA only the CPU-side parts run and the rest are
listed as skipped (exit status 0). Results go to `--out` (given before or after the part's name): `bench.json`
(everything, with the goals and whether each was met) and, when the connector or ttft part ran (they need CUDA)
and matplotlib is installed, `bench.png`; the console says why when it is not drawn. Performance is reported
here, never asserted.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console
from rich.table import Table

from kvfsm.bench import plot
from kvfsm.mooncake import available as mooncake_available
from kvfsm.options import folder_option

PARTS = ("scheduler", "disk", "transfer", "connector", "ttft", "vllm-layers", "mooncake", "mla")
GPU_PARTS = ("transfer", "connector", "ttft", "vllm-layers")
CONNECTOR_TIMINGS = {"sustained steps": "_sustained"}
"""The reading the connector's share goals are judged on, and the suffix of its figures in a connector row.

A share is a bandwidth, and an engine's bandwidth is what its copy engines move while it keeps stepping: each
step's bookkeeping overlaps earlier steps' copies. One step timed by itself also carries that bookkeeping, before
its first copy and after its last, with nothing to overlap: ~1 ms of a 1 GiB step (512 blocks, about three block
transitions each at the scheduler half's ~0.7 µs), which caps its share near 0.95 however fast the copies run.
That cost is reported as one step's fixed ms (`end_to_end._fixed_ms`), with the shares at the step's end and as
jobs finish beside it, not judged as a bandwidth."""
CONNECTOR_GOALS = {
    "per-layer store / load share of ceiling": 0.95,
    "cross-layer store / load share of ceiling": 0.97,
    "both-ways share of ceiling": 0.90,
}
GOALS = {
    **{f"{goal}, {timing}": (">=", target) for timing in CONNECTOR_TIMINGS for goal, target in CONNECTOR_GOALS.items()},
    "matmul slowdown while moving blocks": ("<=", 1.02),
    "µs per block transition (manager)": ("<=", 1.0),
    "µs per block transition (whole scheduler half)": ("<=", 1.0),
    "µs per quiet decode step, 256 running (whole scheduler half)": ("<=", 50.0),
    "reload TTFT over its floor at 32k tokens": ("<=", 1.15),
    "vLLM worker's per-layer reload over its floor at 32k tokens": ("<=", 1.15),
    "reload speedup over recompute at 32k tokens": (">=", 15.0),
    "reload speedup over recompute at 8k tokens": (">=", 6.0),
}
CONNECTOR_BLOCK_TOKENS = (16, 32, 64)
FULL_LAYERS = 32

app = typer.Typer(add_completion=False, help=__doc__)
console = Console(width=130)


def _free_gpu() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _scheduler(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import scheduler, steps

    size = {"steps": 6, "requests": 16, "num_slots": 512, "documents": 32} if quick else {}
    step_size = {"steps": 8, "requests": 16, "lifetime": 2, "documents": 8, "repeats": 1} if quick else {}
    result["scheduler"] = {
        "manager": {policy: scheduler.run(policy, **size) for policy in scheduler.POLICIES},  # type: ignore[arg-type]
        "steps": steps.run(**step_size),  # type: ignore[arg-type]
        "steps_by_policy": {policy: steps.run(**step_size, eviction=policy)["us_per_cpu_block_transition"]
                            for policy in scheduler.POLICIES if policy != "lru"},  # type: ignore[arg-type]
        "steady": steps.steady_decode(**({"requests": 16, "rounds": 1} if quick else {})),
    }


def _disk(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import disk

    result["disk"] = disk.run(total_bytes=(32 << 20) if quick else (1 << 30), reps=1 if quick else 3)


def _transfer(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import transfer
    from kvfsm.executor import CudaDevice

    device = CudaDevice()
    reps = 2 if quick else 9
    result["ceilings"] = transfer.ceilings(device, (1 << 28) if quick else transfer.GIB, reps)
    result["mechanisms"] = {layout: transfer.mechanisms(device, layout, 256 if quick else 1024, result["ceilings"],
                                                        reps) for layout in ("kv-first", "cross-layer")}
    _free_gpu()


def _connector(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import end_to_end
    from kvfsm.executor import CudaDevice

    if "ceilings" not in result:
        _transfer(result, quick)
    device = CudaDevice()
    rows = []
    for layout in ("kv-first", "cross-layer"):
        for tokens in CONNECTOR_BLOCK_TOKENS:
            rows.append(end_to_end.run(device, layout, tokens, result["ceilings"],
                                      moved_bytes=(1 << 28) if quick else (1 << 30), reps=2 if quick else 9))
            _free_gpu()
    result["connector"] = rows
    from kvfsm.bench import token_copy

    result["token_copy"] = token_copy.run(stored_blocks=64 if quick else 512, trials=3 if quick else 15)
    _free_gpu()


def layers_that_fit(free_bytes: int, max_tokens: int) -> int:
    """The most Llama-3-8B layers (up to 32) whose weights, paged and contiguous KV and prefill activations fit."""
    per_layer = 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # bf16 q, o, k, v and the MLP
    per_layer += 4 * max_tokens * 8 * 128 * 2 * 2  # KV: recompute's, its copy, the paged cache, the gathered one
    fixed = 2 * 2 * 128256 * 4096 + 24 * max_tokens * 14336  # embeddings, lm_head; MLP activations of a prefill
    return max(1, min(FULL_LAYERS, (free_bytes - fixed) // per_layer))


def _ttft(result: dict[str, Any], quick: bool) -> None:
    import torch

    from kvfsm.bench import transfer, ttft
    from kvfsm.executor import CudaDevice

    if "ceilings" not in result:  # the reload's floor is the prefix over this run's host-to-device ceiling
        result["ceilings"] = transfer.ceilings(CudaDevice(), (1 << 28) if quick else transfer.GIB, 2 if quick else 5)
    _free_gpu()
    prompts = (2048,) if quick else (2048, 8192, 32768)
    layers = layers_that_fit(torch.cuda.mem_get_info()[0], max(prompts))
    shape = ttft.Shape(num_layers=4 if quick else layers)
    result["ttft"] = ttft.run(CudaDevice(), prompts, shape, reps=1 if quick else 5,
                              h2d_gbps=result["ceilings"]["h2d"])
    if shape.num_layers < FULL_LAYERS:
        result["ttft"]["note"] = (f"{shape.num_layers} of 32 layers fit; times are as measured, not scaled "
                                  "(both paths scale about linearly with layers, so the speedup carries over)")
    _free_gpu()


def _vllm_layers(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import transfer, vllm_layers
    from kvfsm.executor import CudaDevice

    if "ceilings" not in result:  # the reload's floor is the prefix over this run's host-to-device ceiling
        result["ceilings"] = transfer.ceilings(CudaDevice(), (1 << 28) if quick else transfer.GIB, 2 if quick else 5)
    _free_gpu()
    prefix = vllm_layers.Prefix(layers=4) if quick else vllm_layers.Prefix()
    result["vllm_layers"] = vllm_layers.run(CudaDevice(), prefix, trials=2 if quick else 9,
                                            race_trials=3 if quick else 20, h2d_gbps=result["ceilings"]["h2d"])
    _free_gpu()


def _mooncake(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import mooncake

    result["mooncake"] = [mooncake.run(quick, segment) for segment in ("segment host", "own")]


def _mla(result: dict[str, Any], quick: bool) -> None:
    """On two GPUs the figures; without CUDA the byte counts on SimDevices (a second); with one GPU, why not."""
    import torch

    from kvfsm.bench import mla

    if not torch.cuda.is_available():
        result["mla"] = {**mla.run(mla.PLUMBING, cuda=False), "note": "SimDevices: byte counts, no bandwidth"}
        return
    try:
        result["mla"] = mla.run(mla.QUICK if quick else mla.MlaShape())
    except mla.TwoDevicesNeeded as refused:
        result["mla"] = {"note": f"not run: {refused}"}


RUNNERS: dict[str, Callable[[dict[str, Any], bool], None]] = {
    "scheduler": _scheduler, "disk": _disk, "transfer": _transfer, "connector": _connector, "ttft": _ttft,
    "vllm-layers": _vllm_layers, "mooncake": _mooncake, "mla": _mla,
}


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with the figure it is judged on (the worst case where a goal covers several) and whether it holds."""
    measured: dict[str, tuple[float, str]] = {}
    rows = {(r["layout"], r["block_tokens"]): r for r in result.get("connector", [])}
    if rows:
        per_layer, cross = rows[("kv-first", 16)], rows[("cross-layer", 16)]
        for timing, suffix in CONNECTOR_TIMINGS.items():
            shares = {
                "per-layer store / load share of ceiling": (
                    min(per_layer[f"store_share{suffix}"], per_layer[f"load_share{suffix}"]),
                    "connector end to end, kv-first, 16-token blocks"),
                "cross-layer store / load share of ceiling": (
                    min(cross[f"store_share{suffix}"], cross[f"load_share{suffix}"]),
                    "connector end to end, cross-layer, 16-token blocks"),
                "both-ways share of ceiling": (
                    min(per_layer[f"both_share{suffix}"], cross[f"both_share{suffix}"]),
                    "connector end to end, both layouts, 16-token blocks"),
            }
            measured.update({f"{goal}, {timing}": figure for goal, figure in shares.items()})
    if "mechanisms" in result:
        measured["matmul slowdown while moving blocks"] = (
            max(result["mechanisms"][layout]["auto"]["compute_slowdown"] for layout in result["mechanisms"]),
            "auto mechanism, both ways, worse layout, median of per-trial ratios")
    ttft_rows = {r["prompt_tokens"]: r for r in result.get("ttft", {}).get("rows", [])}
    if 32768 in ttft_rows:
        measured["reload TTFT over its floor at 32k tokens"] = (
            ttft_rows[32768]["reload_over_floor"], "per-layer reload / (prefix bytes / H2D ceiling of the run)")
        measured["reload speedup over recompute at 32k tokens"] = (ttft_rows[32768]["speedup"], "medians")
    layers = result.get("vllm_layers", {})
    if (layers.get("prompt_tokens"), layers.get("layers")) == (32768, FULL_LAYERS):  # not `--quick`'s 4 layers
        measured["vLLM worker's per-layer reload over its floor at 32k tokens"] = (
            result["vllm_layers"]["median_over_floor"],
            f"median of {result['vllm_layers']['trials']} trials / (prefix bytes / H2D ceiling of the run)")
    if 8192 in ttft_rows:
        measured["reload speedup over recompute at 8k tokens"] = (ttft_rows[8192]["speedup"], "medians")
    if "scheduler" in result:
        measured["µs per block transition (manager)"] = (
            max(r["us_per_transition"] for r in result["scheduler"]["manager"].values()), "worst of the built-ins")
        measured["µs per block transition (whole scheduler half)"] = (
            max(result["scheduler"]["steps"]["us_per_cpu_block_transition"],
                *result["scheduler"]["steps_by_policy"].values()),
            "all scheduler-half wall time / CPU-block transitions, fastest of the repeats, worst of the built-ins")
        steady = result["scheduler"]["steady"]
        measured["µs per quiet decode step, 256 running (whole scheduler half)"] = (
            steady["us_per_step"], f"median step of the fastest of {steady['rounds']} rounds ({steady['steps']} steps in "
                                   f"all), {steady['running_requests']} running, GC on")
    out = []
    for goal, (op, target) in GOALS.items():
        if goal not in measured:
            continue
        value, basis = measured[goal]
        met = value >= target if op == ">=" else value <= target
        out.append({"goal": goal, "target": f"{op} {target}", "measured": value, "basis": basis, "met": met})
    return out


def _generations(collected: dict[str, int]) -> str:
    """`gen0/gen1/gen2` counts of the collections a timed part ran."""
    return "/".join(str(collected[f"gen{g}"]) for g in range(3))


def _print(result: dict[str, Any]) -> None:
    if "mechanisms" in result:
        from kvfsm.bench import transfer

        console.print(transfer.table(result["device"], result["ceilings"], result["mechanisms"]))
    if result.get("connector"):
        table = Table(title="kvfsm.Connector end to end (scheduler orders, worker executes; GB/s of one engine step "
                            "reported at its end; shares at the step's end / as jobs finish / sustained over "
                            "steps back to back, the goals judged on sustained; one step's fixed ms beyond its "
                            "bytes at the ceiling, store / load / both)")
        for column in ("layout", "block tokens", "mechanism", "store GB/s", "share", "load GB/s", "share",
                       "both GB/s", "share", "step's fixed ms"):
            table.add_column(column, justify="right")
        for r in result["connector"]:
            table.add_row(r["layout"], str(r["block_tokens"]), r["mechanism"],
                          *(cell for kind in ("store", "load", "both")
                            for cell in (f"{r[f'{kind}_gbps']:.1f}", " / ".join(
                                f"{r[f'{kind}_share{suffix}']:.3f}" for suffix in ("", "_as_finished", "_sustained")))),
                          " / ".join(f"{r[f'{kind}_fixed_ms']:.2f}" for kind in ("store", "load", "both")))
        console.print(table)
    if "token_copy" in result:
        tc = result["token_copy"]
        table = Table(title=f"Sampled-token copy after a forward that stores {tc['stored_bytes'] >> 20} MiB")
        for column in ("stores", "median ms", "p90 ms"):
            table.add_column(column, justify="right")
        for mode in ("deferred", "per-layer"):
            table.add_row(mode, f"{tc[mode]['median_ms']:.3f}", f"{tc[mode]['p90_ms']:.3f}")
        console.print(table)
    if "scheduler" in result:
        s = result["scheduler"]
        table = Table(title="Scheduler side (CPU)")
        for column in ("what", "µs / block transition", "detail"):
            table.add_column(column)
        for policy, r in s["manager"].items():
            table.add_row(f"OffloadingManager ({policy})", f"{r['us_per_transition']:.3f}",
                          f"{r['transitions']:,} transitions, hit rate {r['hit_rate']:.1%}")
        st = s["steps"]
        runs = ", ".join(f"{w:.3f}" for w in st["runs_us_per_cpu_block_transition"])
        cpu_runs = ", ".join(f"{c:.3f}" for c in st["runs_cpu_us_per_cpu_block_transition"])
        table.add_row("SchedulerConnector per step (lru)", f"{st['us_per_cpu_block_transition']:.3f}",
                      f"{st['running_requests']} running x {st['prompt_tokens']}-token prompts: "
                      f"{st['us_per_step']:.0f} µs/step, {st['us_per_transition']:.3f} µs per transition of any kind; "
                      f"fastest of runs {runs} (CPU time {cpu_runs}); "
                      f"GC on, collections {_generations(st['gc_collections'])}")
        for policy, figure in s["steps_by_policy"].items():
            table.add_row(f"SchedulerConnector per step ({policy})", f"{figure:.3f}", "the same workload")
        sd = s["steady"]
        table.add_row("SchedulerConnector, quiet decode step", "—",
                      f"{sd['running_requests']} running, none completing a block: {sd['us_per_step']:.1f} µs/step "
                      f"(rounds' medians {', '.join(f'{m:.1f}' for m in sd['us_per_step_rounds'])}, slowest step "
                      f"{sd['us_per_step_max']:.0f} µs; CPU time {sd['cpu_us_per_step']:.1f}, slowest "
                      f"{sd['cpu_us_per_step_max']:.0f}); "
                      f"GC on, collections {_generations(sd['gc_collections'])}")
        console.print(table)
    if "disk" in result:
        d = result["disk"]
        table = Table(title=f"Disk tier vs a plain sequential write/read of the same {d['bytes'] / 2**20:.0f} MiB "
                            f"({d['filesystem']}, {d['block_bytes'] >> 20} MiB blocks, {d['threads']} I/O threads, "
                            f"median of {d['reps']})")
        for column in ("", "sequential GB/s", "disk tier GB/s", "share of sequential"):
            table.add_column(column, justify="right")
        table.add_row("write (to fdatasync)", f"{d['sequential_write_gbps']:.2f}", f"{d['tier_write_gbps']:.2f}",
                      f"{d['write_share']:.2f}")
        table.add_row("read (cold, CRC-verified)", f"{d['sequential_read_gbps']:.2f}", f"{d['tier_read_gbps']:.2f}",
                      f"{d['read_share']:.2f}")
        console.print(table)
    if "ttft" in result:
        t = result["ttft"]
        table = Table(title=f"Time to first token on a CPU prefix hit ({t['num_layers']}-layer Llama-3-8B shape, "
                            f"per-layer reload; floor = prefix bytes / H2D ceiling {t['h2d_gbps']:.1f} GB/s)")
        for column in ("prompt", "recompute ms", "reload ms", "speedup", "floor ms", "reload / floor",
                       "logits rel. err"):
            table.add_column(column, justify="right")
        for r in t["rows"]:
            table.add_row(f"{r['prompt_tokens']:,}", f"{r['recompute_ms']:.1f}", f"{r['reload_ms']:.1f}",
                          f"{r['speedup']:.1f}x", f"{r['floor_ms']:.1f}", f"{r['reload_over_floor']:.2f}",
                          f"{r['logits_relative_error']:.1e}")
        console.print(table)
    if "vllm_layers" in result:
        from kvfsm.bench import vllm_layers

        console.print(vllm_layers.table(result["vllm_layers"]))
    if "mooncake" in result:
        table = Table(title="Mooncake tier, GB/s (median; baseline = the store's put_batch / get_batch of the same "
                            "bytes, same run)")
        for column in ("objects live in", "block", "baseline put", "zero-copy put", "tier write-back", "share",
                       "of zero-copy", "baseline get", "zero-copy get", "tier fetch", "share", "of zero-copy"):
            table.add_column(column, justify="right")
        for r in result["mooncake"]:
            g = r["gbps"]
            table.add_row(r["segment"], f"{r['block_bytes'] >> 10} KiB", f"{g['baseline put']:.2f}",
                          f"{g['zero-copy put']:.2f}", f"{g['tier write-back']:.2f}",
                          f"{r['write_back_share_of_baseline']:.2f}", f"{r['write_back_share_of_zero_copy']:.2f}",
                          f"{g['baseline get']:.2f}", f"{g['zero-copy get']:.2f}", f"{g['tier fetch']:.2f}",
                          f"{r['fetch_share_of_baseline']:.2f}", f"{r['fetch_share_of_zero_copy']:.2f}")
        console.print(table)
    if result.get("mla", {}).get("rows"):
        from kvfsm.bench import mla

        console.print(mla.table(result["mla"]))
    if result.get("mla", {}).get("note"):
        console.print(f"mla: {result['mla']['note']}")
    table = Table(title="Goals")
    for column in ("goal", "target", "measured", "met", "judged on"):
        table.add_column(column)
    for v in result["verdicts"]:
        table.add_row(v["goal"], v["target"], f"{v['measured']:.3f}", "met" if v["met"] else "NOT met", v["basis"])
    console.print(table)
    if result["skipped"]:
        console.print(f"skipped (no CUDA device, or Mooncake not installed): {', '.join(result['skipped'])}")
    for part, error in result["errors"].items():
        console.print(f"[red]{part} failed[/red]: {error}")


def collect(parts: tuple[str, ...], out: Path, quick: bool) -> dict[str, Any]:
    """Run `parts` in order, write `bench.json` and `bench.png` (or why not) into `out`, print the tables; returns
    the result."""
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
            RUNNERS[part](result, quick)
        except Exception as error:  # one broken part must not lose the others' figures; the exit status says it
            errors[part] = f"{type(error).__name__}: {error}"
            console.print_exception()
    result["errors"] = errors
    result["verdicts"] = verdicts(result)
    out.mkdir(parents=True, exist_ok=True)
    not_drawn = plot.save(result, out / "bench.png")
    result["plot"] = not_drawn or "bench.png"
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    _print(result)
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
    _one(_part)


VLLM_PARTS = ("workloads", "inline", "tiers")
"""The `vllm` command's comparisons: the connectors over the workloads, `layer_loads` inline, the tiered workload."""


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
        from kvfsm.integrations.vllm import bench_inline, bench_tiers
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
