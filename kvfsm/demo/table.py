"""The demo's result as a rich table: the two runs side by side, then the integrity verdict.

Only presentation lives here: the figures come from `kvfsm.demo.results`, and the verdict is `DemoResult.ok`.
"""

from __future__ import annotations

from rich.table import Table

from kvfsm.connector.stats import ConnectorStats
from kvfsm.demo.results import DemoResult


def _rate(nbytes: int, seconds: float) -> str:
    if seconds <= 0:
        return "-"
    rate = nbytes / seconds
    return f"{rate / 1e9:.2f} GB/s" if rate >= 1e8 else f"{rate / 1e6:.2f} MB/s"


def render(result: DemoResult) -> Table:
    """The two runs side by side, then the integrity verdict."""
    base, off = result.baseline, result.offloaded
    stats = off.stats or ConnectorStats()
    simulated = off.device == "sim"
    table = Table(title=f"{result.requests} requests on {'SimDevice (CPU)' if simulated else 'CUDA'}, "
                        f"{result.config.gpu_blocks} GPU blocks, {result.config.cpu_blocks} CPU blocks "
                        f"(factor {result.config.block_size_factor}, {result.config.eviction.value})")
    table.add_column("")
    table.add_column("without offloading", justify="right")
    table.add_column("with kvfsm", justify="right")

    def row(name: str, without: object, with_: object) -> None:
        table.add_row(name, str(without), str(with_))

    tiers = off.tier_stats
    from_below = sum(tiers.tokens_loaded_from.values()) if tiers is not None else 0
    row("prefix tokens served from GPU", base.gpu_hit_tokens, off.gpu_hit_tokens)
    row("prefix tokens served from CPU (reloaded)", 0, off.cpu_hit_tokens - from_below)
    if tiers is not None:
        for tier in tiers.blocks_written_back.keys() | tiers.tokens_loaded_from.keys():
            row(f"prefix tokens served from {tier} (fetched to CPU, reloaded)", 0, tiers.tokens_loaded_from[tier])
            row(f"CPU→{tier} written back / {tier}→CPU fetched (blocks)", "-",
                f"{tiers.blocks_written_back[tier]} / {tiers.blocks_fetched[tier]}")
        row("lower-tier keys that failed to move", "-",
            ", ".join(f"{k} {n}" for k, n in tiers.failures.items()) or "0")
    row("tokens computed", base.computed_tokens, off.computed_tokens)
    row("  of which recomputed (beyond an unbounded cache)",
        max(0, base.computed_tokens - result.minimum_compute), max(0, off.computed_tokens - result.minimum_compute))
    row("preemptions", base.preemptions, off.preemptions)
    row("GPU→CPU stored (blocks / MB)", "-", f"{stats.blocks_stored} / {stats.bytes_stored / 1e6:.2f}")
    row("CPU→GPU loaded (blocks / MB)", "-", f"{stats.blocks_loaded} / {stats.bytes_loaded / 1e6:.2f}")
    over = "averaged over wall time" + (", simulated" if simulated else "")
    row(f"store rate ({over})", "-", _rate(stats.bytes_stored, off.wall_s))
    row(f"load rate ({over})", "-", _rate(stats.bytes_loaded, off.wall_s))
    row("lookups deferred / stores refused", "-", f"{stats.deferrals} / {stats.store_refusals}")
    row("engine steps", base.steps, off.steps)
    row("wall time serving (s)", f"{base.wall_s:.2f}", f"{off.wall_s:.2f}")
    row("wall time checking invariants (s)", "-", f"{off.check_s:.2f}")
    table.add_section()
    identical = "identical" if result.outputs_identical else "DIFFERENT"
    table.add_row("outputs vs run without offloading", "", identical)
    checked = "all steps" if simulated else "all steps; state only: CUDA keeps no access log for the ordering ones"
    table.add_row(f"invariant violations ({checked})", "", str(sum(off.violations.values())))
    table.add_row("requests that read poisoned KV", "", str(len(result.poisoned)))
    table.add_row("integrity", "", "[green]PASS[/green]" if result.ok else "[red]FAIL[/red]")
    return table

