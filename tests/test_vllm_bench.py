"""`python -m kvfsm.bench vllm` plumbing at small sizes: every workload runs through all three connectors.

Figures are reported by the benchmark, never asserted here. Skipped without vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm import bench, bench_workloads  # noqa: E402
from kvfsm.integrations.vllm.bench_table import markdown  # noqa: E402

pytestmark = pytest.mark.vllm


def test_the_zipf_workload_runs_through_no_connector_then_vllms_and_kvfsms_under_each_admission_setting() -> None:
    rows = list(bench.compare(["zipf-prefixes"], quick=True))
    assert [(row["connector"], row["admission"]) for row in rows] == [
        ("none", "-"), *((c, a) for a in bench.ADMISSION for c in ("vllm", "kvfsm"))]
    by_run = {(row["connector"], row["admission"]): row for row in rows}
    assert by_run[("none", "-")]["loads"] == 0
    assert by_run[("vllm", "every-block")]["loads"] > 0 and by_run[("kvfsm", "every-block")]["loads"] > 0
    assert all(row["first_tokens"] > 0 and row["steps"] > 0 for row in rows)
    assert "| zipf-prefixes | kvfsm | prompt-only |" in bench.markdown(rows)


def test_the_abort_storm_aborts_each_wave_mid_decode() -> None:
    sizes = bench_workloads.QUICK_SIZES["abort-storm"]
    workload = bench_workloads.abort_storm(**sizes)
    arrived = {step: [a.req_id for a in workload.arrivals(step)] for step in range(workload.steps)}
    aborted = {step: workload.aborts(step) for step in range(workload.steps)}
    waves = {step: ids for step, ids in arrived.items() if ids}
    assert len(waves) == sizes["waves"]
    assert {step + sizes["abort_after"]: ids for step, ids in waves.items()} == {s: i for s, i in aborted.items() if i}
    assert sizes["abort_after"] < sizes["decode_tokens"]  # aborted before it could finish


def test_requests_that_end_with_stores_in_flight_make_vllm_hold_no_block_for_kvfsm() -> None:
    """`request_finished` answers False with only stores in flight (`lazy-fence`): in the storms built for it, vLLM
    keeps no GPU block of an ended request for kvfsm, at any measured step."""
    rows = list(bench.compare(["abort-storm-early", "preemption-burst-tail"], quick=True, admission=["every-block"]))
    kvfsm = [row for row in rows if row["connector"] == "kvfsm"]
    assert len(kvfsm) == 2 and all(row["held_blocks_max"] == 0 and row["blocks_stored"] > 0 for row in kvfsm)


def test_returning_prefixes_reach_first_token_sooner_with_layer_loads_for_every_cpu_hit() -> None:
    """The plumbing of the inline comparison, and the claim it exists for: in steps, with vLLM's scheduling
    synchronous every CPU hit computes earlier with `layer_loads` than with vLLM's connector, with the same tokens;
    under async scheduling `layer_loads` loads asynchronously and gains nothing (nor loses)."""
    from kvfsm.integrations.vllm import bench_inline

    rows = {(row["scheduling"], row["run"]): row for row in bench_inline.compare_inline(quick=True)}
    assert rows.keys() == {(s, r) for s in bench_inline.SCHEDULING for r in bench_inline.RUNS}
    assert rows["sync", "kvfsm layer_loads"]["fewest_steps_gained"] >= 1
    assert rows["async", "kvfsm layer_loads"]["fewest_steps_gained"] == 0
    for scheduling in bench_inline.SCHEDULING:  # asynchronous loads: as vLLM's connector
        assert rows[scheduling, "kvfsm"]["fewest_steps_gained"] == 0
    assert all(row["same_tokens"] and row["cpu_hit_blocks"] > 0 for row in rows.values())
    assert "| returning-prefixes | sync | kvfsm layer_loads |" in markdown(list(rows.values()), bench_inline.COLUMNS)


def test_the_tiered_comparison_measures_and_tables_a_row_per_connector() -> None:
    """The plumbing of the tiered comparison: every connector's row is measured and tabled. How many tokens each serves
    from below DRAM is the benchmark's figure, not this test's: the tiers' I/O runs on threads and races steps given
    a tiny model step here (0.2 ms, for speed), so on a busy machine a quick run of either connector can see none
    (the bytes of a reload from disk are checked, deterministically, in test_vllm_tiers.py)."""
    from kvfsm.integrations.vllm import bench_tiers

    rows = {row["run"]: row for row in bench_tiers.compare_tiers(quick=True, step_ms=0.2)}
    assert tuple(rows) == bench_tiers.RUNS and all(row["step_ms"] == 0.2 for row in rows.values())
    assert all(row["tokens_from_below"] >= 0 for row in rows.values())
    assert "| tiered-prefixes | kvfsm disk eager |" in markdown(list(rows.values()), bench_tiers.COLUMNS)
