"""The benchmark's figure: bandwidth by mechanism and block size against the ceilings, and TTFT recompute vs reload.

matplotlib is optional (the CPU path never needs it): `save` says why it drew nothing instead of failing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DIRECTIONS = (("store", "D2H"), ("load", "H2D"), ("both", "both"))


def _bars(ax: Any, result: dict[str, Any]) -> None:
    rows = [(f"{layout}\n{name}", e) for layout, entries in result["mechanisms"].items()
            for name, e in entries.items() if name != "auto"]
    rows += [(f"{r['layout']}\nconnector {r['block_tokens']}-tok", r) for r in result["connector"]]
    width = 0.27
    for i, (direction, _) in enumerate(DIRECTIONS):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], [e[f"{direction}_gbps"] for _, e in rows],
               width, label=direction)
    colors = ("tab:blue", "tab:orange", "tab:green")
    for (direction, key), color in zip(DIRECTIONS, colors):
        ax.axhline(result["ceilings"][key.lower()], color=color, linestyle="--", linewidth=0.8,
                   label=f"contiguous {key} ceiling")
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title("KV blocks moved (Llama-3-8B shape, scattered blocks)")
    ax.legend(fontsize=7, ncol=2)


def _ttft(ax: Any, ttft: dict[str, Any]) -> None:
    rows = ttft["rows"]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["recompute_ms"] for r in rows], 0.4, label="recompute (prefill)")
    ax.bar([x + 0.2 for x in xs], [r["reload_ms"] for r in rows], 0.4, label="kvfsm reload + last block")
    for x, r in zip(xs, rows):
        ax.annotate(f"{r['speedup']:.1f}x", (x, r["recompute_ms"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"{r['prompt_tokens']:,} tokens" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, ms")
    ax.set_title(f"TTFT on a CPU prefix hit ({ttft['num_layers']}-layer Llama-3-8B shape)")
    ax.legend(fontsize=8)


def save(result: dict[str, Any], path: Path) -> str | None:
    """Draw what `result` holds into `path`; returns why nothing was drawn, or None."""
    panels = [p for p in ("connector", "ttft") if result.get(p)]
    if not panels:
        return "no GPU measurement to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "connector":
            _bars(ax, result)
        else:
            _ttft(ax, result["ttft"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
