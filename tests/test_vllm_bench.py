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
