"""Controls of `longest-window-hit`: the vLLM adapter's lookup with one half of the rule broken.

The rule lives in `kvfsm.integrations.vllm.window_hit.WindowHits`, which this layer cannot import: a mutant patches
one instance (its attributes only, nothing global), handed over by a test under vLLM's Scheduler
(tests/test_vllm_window_hit.py), which must catch each.
"""

from __future__ import annotations

from typing import Any, Callable


def no_shorter_window_hit(hits: Any) -> None:
    """The rule before the shorter hit: a window missing where the full-attention hit ends offers no hit at all, so
    vLLM recomputes a whole prefix whose earlier windows the CPU pool holds (breaks the rule's `longest` half)."""
    hits.longest_end = lambda views, first, end: first


def window_one_block_short(hits: Any) -> None:
    """A window is held from its second block on: a hit is offered where a window's first block is missing, and vLLM
    computes past it on a block nobody loaded (breaks the rule's `whole` half)."""
    start = hits.window_start
    hits.window_start = lambda group, first, end: min(end, start(group, first, end) + 1)


WINDOW_HIT_MUTANTS: dict[str, Callable[[Any], None]] = {
    "no-shorter-window-hit": no_shorter_window_hit,
    "window-one-block-short": window_one_block_short,
}
"""The mutants of `longest-window-hit`, by name."""
