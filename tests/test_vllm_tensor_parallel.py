"""kvfsm's vLLM adapter with tensor parallelism, under vLLM's real Scheduler: two fake workers (ranks), their
outputs combined by vLLM's own `KVOutputAggregator`. A job ends only when both ranks reported it; a load one rank
failed fails for both and vLLM recomputes. Skipped when vLLM is not installed."""

from __future__ import annotations

from typing import Iterator

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker, vllm_config  # noqa: E402
from vllm_harness import ComputedWhileLoading, Driver, FakeRanks  # noqa: E402
from kvfsm.integrations.vllm.worker_side import engine_rank  # noqa: E402
from kvfsm.testing.mutants import complete_on_first_report  # noqa: E402
from vllm_support import model  # noqa: E402,F401  (the tiny model fixture)

pytestmark = pytest.mark.vllm

PROMPT = list(range(100, 100 + 4 * BLOCK_SIZE)) + [1, 2, 3]


@pytest.fixture
def two_ranks(model) -> Iterator:
    """Builds drivers of two fake ranks on the tiny model and stops their tracing when the test ends."""
    opened: list[Driver] = []

    def build(*workers: FakeWorker) -> Driver:
        d = Driver(vllm_config(model, {"cpu_blocks": 32}, 64, tensor_parallel_size=2), FakeRanks(list(workers)))
        opened.append(d)
        return d

    yield build
    for d in opened:
        d.close()


def reload(d: Driver) -> int:
    """A writer stores the prompt, vLLM's GPU cache forgets it, a reader reloads it: the reader's computed tokens
    when it is first scheduled."""
    d.add("writer", PROMPT)
    d.run()
    d.reset_gpu_prefix_cache()
    d.add("reader", PROMPT)
    d.run()
    return next(log.first_computed["reader"] for log in d.log if "reader" in log.first_computed)


def test_num_workers_is_vllms_world_size(two_ranks) -> None:
    d = two_ranks(FakeWorker(rank=0), FakeWorker(rank=1))
    assert d.connector.scheduler_side.kvfsm.config.num_workers == 2


def test_a_rank_is_its_place_in_its_engine_with_data_parallel_ranks_offset() -> None:
    assert [engine_rank(global_rank, world_size=2) for global_rank in range(6)] == [0, 1, 0, 1, 0, 1]


def test_a_load_waits_for_the_slower_rank(two_ranks) -> None:
    d = two_ranks(FakeWorker(rank=0, load_steps=1), FakeWorker(rank=1, load_steps=3))
    assert reload(d) == len(PROMPT) - len(PROMPT) % BLOCK_SIZE
    assert d.cpu_pool_drained()


def test_control_completing_on_the_first_rank_report_breaks_every_rank_reports(two_ranks) -> None:
    d = two_ranks(FakeWorker(rank=0, load_steps=1), FakeWorker(rank=1, load_steps=3))
    complete_on_first_report(d.connector.scheduler_side.kvfsm)
    with pytest.raises(SpecViolation, match="every-rank-reports: load job .* reports from ranks \\[0\\] of 2"):
        reload(d)


def test_control_completing_on_the_first_rank_report_computes_on_a_loading_rank(two_ranks) -> None:
    """The hazard `every-rank-reports` rules out, seen from vLLM with kvfsm's own checks off: the request is
    scheduled while the slower rank still loads its heads."""
    d = two_ranks(FakeWorker(rank=0, load_steps=1), FakeWorker(rank=1, load_steps=3))
    complete_on_first_report(d.connector.scheduler_side.kvfsm)
    d.checks.after_step = lambda step: None  # type: ignore[method-assign]
    with pytest.raises(ComputedWhileLoading):
        reload(d)


def test_a_load_one_rank_failed_fails_on_both_and_is_recomputed(two_ranks) -> None:
    d = two_ranks(FakeWorker(rank=0), FakeWorker(rank=1, fail_loads={"reader"}))
    assert reload(d) == 0, "vLLM used blocks that one rank never loaded"
    kvfsm = d.connector.scheduler_side.kvfsm
    assert kvfsm.stats.loads_failed == 1 and d.first_token.keys() == {"writer", "reader"}
    assert d.cpu_pool_drained()
