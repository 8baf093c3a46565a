"""The console tables of one bench run: one per part that ran, then the goals, the skipped parts and the errors.

Printing only: every figure here was measured and judged before (`parts`, `goals`), so the tables can be drawn
again from a saved `bench.json`.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(width=130)


def _generations(collected: dict[str, int]) -> str:
    """`gen0/gen1/gen2` counts of the collections a timed part ran."""
    return "/".join(str(collected[f"gen{g}"]) for g in range(3))


def show(result: dict[str, Any]) -> None:
    """Print the tables of `result` on the console."""
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
        for admission, by_policy in s.get("steps_by_admission", {}).items():
            for policy, r in by_policy.items():
                table.add_row(f"SchedulerConnector per step ({policy}, {admission})",
                              f"{r['us_per_cpu_block_transition']:.3f}",
                              f"the same workload; {r['blocks_skipped']:,} blocks skipped, "
                              f"{r['us_per_block_decision']:.3f} µs per transition or skip")
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
        for column in ("objects live in", "blocks a call", "MAC threads", "baseline put", "zero-copy put", "tier write-back",
                       "share", "of zero-copy", "MACs alone", "baseline get", "zero-copy get", "tier fetch", "share",
                       "of zero-copy"):
            table.add_column(column, justify="right")
        for r in result["mooncake"]:
            g = r["gbps"]
            table.add_row(r["segment"], f"{r['blocks']} × {r['block_bytes'] >> 10} KiB", str(r["hash_threads"]),
                          f"{g['baseline put']:.2f}", f"{g['zero-copy put']:.2f}", f"{g['tier write-back']:.2f}",
                          f"{r['write_back_share_of_baseline']:.2f}", f"{r['write_back_share_of_zero_copy']:.2f}",
                          f"{g['MACs alone']:.2f}", f"{g['baseline get']:.2f}", f"{g['zero-copy get']:.2f}", f"{g['tier fetch']:.2f}",
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
