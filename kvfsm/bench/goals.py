"""The bench's goals, and the verdict on each: the figure it is judged on, and whether it holds.

Kept apart from the parts that measure so a goal's basis reads in one place, and so a reader of `bench.json` can
see which figure stands for which goal (the worst case where a goal covers several).
"""

from __future__ import annotations

from typing import Any

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
FULL_LAYERS = 32
"""Llama-3-8B's layer count: the most layers a part models, and the only count a vLLM-layers figure is judged on."""


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
