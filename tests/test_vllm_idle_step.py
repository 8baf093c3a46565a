"""An idle step under vLLM's real Scheduler (nothing scheduled, finished or reported, nothing in flight) costs kvfsm's
scheduler half no work: no transition fires, the metadata orders nothing, an on-evict tier's write-back plan stands
(`TierPlanner._plan_stands`) and vLLM's stats request reads no total (`StatsDelta.moved`). What may move a counter
marks the stats moved: every step's stats are those a full read of the totals gives, and a lookup left unmarked (a
control) is caught. Skipped when vLLM is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("vllm")

from kvfsm.connector.metadata import ConnectorMetadata  # noqa: E402
from kvfsm.integrations.vllm.telemetry import POOL, KvfsmStats, StatsDelta  # noqa: E402
from test_vllm_tiers import disk_tier, evict_from_cpu_then_reload, tiered  # noqa: E402
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import model  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm


def test_an_idle_step_fires_nothing_orders_nothing_and_reads_no_totals(tiered: Callable[..., Any],
                                                                        tmp_path: Path) -> None:
    d, workers = tiered(disk_tier(tmp_path / "disk", writeback="on-evict"))
    evict_from_cpu_then_reload(d, workers)
    side = d.connector.scheduler_side
    fired: list[tuple[Any, ...]] = []
    plans: list[int] = []
    reads: list[int] = []
    side.kvfsm.machines.observe(lambda *transition: fired.append(transition))
    planner, stats = side.kvfsm.tiers, side.stats
    plan, totals = planner._plan_write_backs, stats._totals  # type: ignore[union-attr]
    planner._plan_write_backs = lambda step: plans.append(step) or plan(step)  # type: ignore[union-attr,method-assign]
    stats._totals = lambda: reads.append(1) or totals()  # type: ignore[method-assign]
    stats._pool_sampled = float("inf")  # the pool's time-based sample aside
    for _ in range(4):
        assert d.step().orders == ConnectorMetadata(step=side.kvfsm.step)
    d.outputs.flush()
    assert (fired, plans, reads) == ([], [], [])
    assert d.connector.take_events() == () and d.connector.get_kv_connector_stats() is None


def _counters(stats: KvfsmStats | None) -> dict[str, Any]:
    return {k: v for k, v in (stats.data if stats is not None else {}).items() if not k.startswith(POOL)}


def check_stats_against_full_reads(d: Driver, workers: list[AdapterWorker],
                                   control: Callable[[Driver], None] | None = None) -> None:
    """A disk tier's prefix evicted from CPU, then reloaded: the stats vLLM takes each step equal those of a twin
    that reads every total every step (the pool's time-based sample aside)."""
    side = d.connector.scheduler_side
    kvfsm = side.kvfsm
    twin = StatsDelta(kvfsm.stats, kvfsm.manager.usage, kvfsm.tiers.totals)  # type: ignore[union-attr]
    take = side.stats.take

    def checked() -> KvfsmStats | None:
        taken = take()
        twin.moved = True
        assert _counters(taken) == _counters(twin.take())
        return taken

    side.stats.take = checked  # type: ignore[method-assign]
    if control is not None:
        control(d)
    evict_from_cpu_then_reload(d, workers)


def test_the_stats_of_every_step_are_those_a_full_read_gives(tiered: Callable[..., Any], tmp_path: Path) -> None:
    check_stats_against_full_reads(*tiered(disk_tier(tmp_path / "disk")))


def lookup_unmarked(d: Driver) -> None:
    """Control: a lookup does not mark the stats moved (a deferred request's lookup, in a step that schedules and
    reports nothing, moves the lookup and deferral counters unseen)."""
    side = d.connector.scheduler_side
    lookup = side.get_num_new_matched_tokens

    def unmarked(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        moved = side.stats.moved
        answer = lookup(request, num_computed_tokens)
        side.stats.moved = moved
        return answer

    side.get_num_new_matched_tokens = unmarked  # type: ignore[method-assign]


def test_a_lookup_that_does_not_mark_the_stats_moved_is_caught(tiered: Callable[..., Any], tmp_path: Path) -> None:
    with pytest.raises(AssertionError):
        check_stats_against_full_reads(*tiered(disk_tier(tmp_path / "disk")), control=lookup_unmarked)
