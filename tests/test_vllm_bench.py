"""`python -m kvfsm.bench vllm` plumbing at small sizes: every workload runs through all three connectors.

Figures are reported by the benchmark, never asserted here. Skipped without vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm import bench  # noqa: E402

pytestmark = pytest.mark.vllm


def test_the_zipf_workload_runs_through_no_connector_vllms_and_kvfsms() -> None:
    rows = list(bench.compare(["zipf-prefixes"], quick=True))
    assert [row["connector"] for row in rows] == list(bench.CONNECTORS)
    by_connector = {row["connector"]: row for row in rows}
    assert by_connector["none"]["loads"] == 0
    assert by_connector["vllm"]["loads"] > 0 and by_connector["kvfsm"]["loads"] > 0
    assert all(row["first_tokens"] > 0 and row["steps"] > 0 for row in rows)
    assert "| zipf-prefixes | kvfsm |" in bench.markdown(rows)


def test_returning_prefixes_reach_first_token_sooner_with_layer_loads_for_every_cpu_hit() -> None:
    """The plumbing of the inline comparison, and the one claim it exists for: in steps, every CPU hit computes
    earlier with `layer_loads` than with vLLM's connector, with the same tokens."""
    from kvfsm.integrations.vllm import bench_inline

    rows = {row["run"]: row for row in bench_inline.compare_inline(quick=True)}
    assert rows.keys() == bench_inline.RUNS.keys()
    assert rows["kvfsm layer_loads"]["fewest_steps_gained"] >= 1
    assert rows["kvfsm"]["fewest_steps_gained"] == 0  # asynchronous loads: as vLLM's connector
    assert all(row["same_tokens"] and row["cpu_hit_blocks"] > 0 for row in rows.values())
    assert "| returning-prefixes | kvfsm layer_loads |" in bench_inline.markdown(list(rows.values()))
