"""Admission (spec/request.yaml's `skip-store`, invariant `skipped-not-stored`): which completed blocks are stored.

One rule per test, driven through the scheduler half as an engine would: `prompt-only` stores the prompt's blocks
and skips decode blocks, `store_threshold` skips a block until enough requests offered it, the offer counts stay
bounded, `cold-prefix` scope counts only blocks that start a prefix the pool does not hold, and a skip is counted
by reason. The invariant's control, a skip recorded but not applied, is caught on the
reference engine.
"""

from __future__ import annotations

from typing import Any, get_args

import pydantic
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvfsm.config import OffloadConfig, ThresholdScope
from kvfsm.connector.admission import REASONS, Admission
from kvfsm.connector.metrics import COUNTERS
from kvfsm.connector.prometheus import KvfsmCollector
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.connector.stats import SKIPPED_BY_REASON, ConnectorStats
from kvfsm.executor.sim import SimDevice
from kvfsm.records import RequestRecord
from kvfsm.testing.harness import Harness
from test_connector_scheduler import BLOCK, GPU_BLOCK_BYTES, Req, admit, compute, idle_step, prompt, report

PROMPT = (1, 2, 3)
DECODE = (4, 5)


def connector(**admission: Any) -> SchedulerConnector:
    config = OffloadConfig(cpu_blocks=16, gpu_block_size=BLOCK, **admission)
    return SchedulerConnector(config, GPU_BLOCK_BYTES, keep_history=True)


def stored_hashes(sched: SchedulerConnector) -> list[int]:
    return [h for job in sched.jobs.values() if job.kind == "store" for h in job.hashes]


def run_and_decode(sched: SchedulerConnector, req_id: str = "a", first_block: int = 0,
                   decode: tuple[int, ...] = DECODE) -> Req:
    """A request of three prompt blocks (and one token more) computes its prompt, then decodes two more blocks;
    every store it orders completes."""
    req = prompt(req_id, PROMPT)
    blocks = range(first_block, first_block + 6)
    admit(sched, req, blocks)
    ordered = [order.job_id for order in compute(sched, req, blocks).stores]
    for decoded in decode:
        req.block_hashes += (decoded,)
        req.num_tokens += BLOCK
        ordered += [order.job_id for order in compute(sched, req, blocks).stores]
    idle_step(sched)  # the workers submit the last step's stores as this step starts
    report(sched, done=ordered)
    return req


def test_every_block_is_the_default_and_stores_decode_blocks_too() -> None:
    sched = connector()
    run_and_decode(sched)
    assert sorted(stored_hashes(sched)) == [*PROMPT, *DECODE]
    assert sched.stats.blocks_skipped_prompt_only == sched.stats.blocks_skipped_threshold == 0


def test_prompt_only_stores_the_prompt_blocks_and_skips_decode_blocks() -> None:
    sched = connector(admission="prompt-only")
    run_and_decode(sched)
    assert sorted(stored_hashes(sched)) == list(PROMPT)
    assert sched.requests["a"].skipped == dict.fromkeys(DECODE, "prompt-only")
    assert sched.stats.blocks_skipped_prompt_only == len(DECODE)
    assert not sched.manager.lookup(PROMPT + DECODE).busy and sched.manager.lookup(PROMPT + DECODE).hits == 3


def test_a_skipped_block_is_a_skip_store_transition_of_its_running_request() -> None:
    sched = connector(admission="prompt-only")
    seen: list[tuple[str, str, str]] = []
    sched.machines["request"].observers.append(
        lambda lifecycle, model, source, trigger, dest: seen.append((source, trigger, dest)))
    run_and_decode(sched)
    assert seen.count(("running", "skip-store", "running")) == len(DECODE)


def test_a_store_threshold_of_two_stores_a_block_at_its_second_offer() -> None:
    sched = connector(store_threshold=2)
    run_and_decode(sched, "a")
    assert stored_hashes(sched) == []
    assert sched.stats.blocks_skipped_threshold == len(PROMPT + DECODE)
    run_and_decode(sched, "b", first_block=10)
    assert sorted(stored_hashes(sched)) == [*PROMPT, *DECODE]


def test_a_resumed_request_does_not_offer_its_blocks_again() -> None:
    """Preempted and recomputed, a request offers none of its blocks a second time: it cannot reach the threshold
    alone, and what it skipped stays skipped."""
    sched = connector(store_threshold=2)
    req = prompt("a", PROMPT)
    admit(sched, req, range(4))
    compute(sched, req, range(4))
    idle_step(sched, preempted=["a"])
    admit(sched, req, range(4, 8))
    compute(sched, req, range(4, 8))
    idle_step(sched)
    assert stored_hashes(sched) == [] and sched.stats.blocks_skipped_threshold == len(PROMPT)


def test_the_offer_counts_are_bounded() -> None:
    sched = connector(store_threshold=2, store_offers_tracked=2)
    run_and_decode(sched)
    assert list(sched.admission.offers) == list(DECODE)


def cold_prefix(**scope: Any) -> Admission:
    return Admission(OffloadConfig(cpu_blocks=16, store_threshold=2, **scope))


def test_cold_prefix_stores_a_block_extending_a_held_prefix_at_its_first_offer() -> None:
    verdict = cold_prefix(store_threshold_scope="cold-prefix").offer(RequestRecord("a"), 0, (1, 2, 3, 4), {1, 2})
    assert list(verdict.admitted) == [1, 2, 3, 4] and verdict.skipped == {}


def test_control_every_block_scope_counts_a_block_extending_a_held_prefix() -> None:
    verdict = cold_prefix().offer(RequestRecord("a"), 0, (1, 2, 3, 4), {1, 2})
    assert list(verdict.admitted) == [1, 2] and verdict.skipped == {"threshold": (3, 4)}


def test_cold_prefix_skips_a_new_prefix_until_its_second_offer() -> None:
    admission = cold_prefix(store_threshold_scope="cold-prefix")
    first = admission.offer(RequestRecord("a"), 0, (5, 6, 7), set())
    second = admission.offer(RequestRecord("b"), 0, (5, 6, 7), set())
    assert (list(first.admitted), first.skipped) == ([], {"threshold": (5, 6, 7)})
    assert (list(second.admitted), second.skipped) == ([5, 6, 7], {})


@pytest.mark.parametrize(("skipped_parent", "admitted"), [(False, [3]), (True, [])])
def test_cold_prefix_a_later_offer_extends_its_request_s_parent_only_if_admitted(skipped_parent: bool,
                                                                                 admitted: list[int]) -> None:
    record = RequestRecord("a", offered_cpu_blocks=2, skipped={2: "threshold"} if skipped_parent else {})
    verdict = cold_prefix(store_threshold_scope="cold-prefix").offer(record, 2, (3,), set(), parent=2)
    assert list(verdict.admitted) == admitted


@pytest.mark.parametrize(("scope", "stored"), [("cold-prefix", [1, 2, 3, 8, 9]), ("every-block", [1, 2, 3])])
def test_cold_prefix_the_scheduler_stores_decode_blocks_after_an_admitted_prompt(scope: str, stored: list[int]) -> None:
    """An earlier offer of the prompt lets it through at this request's (its second); the decode blocks, offered one
    step at a time after it, are stored at their first offer only under `cold-prefix`: the scheduler passes each
    offer its parent."""
    sched = connector(store_threshold=2, store_threshold_scope=scope)
    sched.admission.offer(RequestRecord("earlier"), 0, PROMPT, set())
    run_and_decode(sched, "a", decode=(8, 9))
    assert sorted(stored_hashes(sched)) == stored


@pytest.mark.parametrize("values", [{"admission": "decode-only"}, {"store_threshold": 0},
                                    {"store_threshold_scope": "warm"},
                                    {"store_threshold": True}, {"store_offers_tracked": 0}])
def test_a_bad_admission_setting_is_refused(values: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError, match=next(iter(values))):
        OffloadConfig(cpu_blocks=8, **values)


def test_skipped_blocks_are_exported_by_reason() -> None:
    sched = connector(admission="prompt-only")
    run_and_decode(sched)
    registry = CollectorRegistry()
    registry.register(KvfsmCollector.of(sched))
    text = generate_latest(registry).decode()
    assert 'kvfsm_store_skipped_total{reason="prompt-only"} 2.0' in text
    assert 'kvfsm_store_skipped_total{reason="threshold"} 0.0' in text


def test_every_skip_reason_has_its_counter_and_its_metric_label() -> None:
    (family,) = [c for c in COUNTERS if c.name == "kvfsm_store_skipped"]
    assert sorted(SKIPPED_BY_REASON) == sorted(REASONS) == sorted(labels["reason"] for labels, _ in family.samples)
    assert all(SKIPPED_BY_REASON[labels["reason"]] == source for labels, source in family.samples)


def offered_once_then_twice(mutant: str | None, scope: ThresholdScope = "every-block"
                            ) -> tuple[list[str], ConnectorStats]:
    """The reference engine with a store threshold of 2 counted over `scope`: a prefix offered once (skipped; under
    `cold-prefix` too, since nothing before it is held), then by a second request after the GPU forgot it (stored);
    every step checked. (Its requests hash prompt blocks alone: a threshold is
    what makes it skip.)"""
    h = Harness(SimDevice(), num_gpu_blocks=24, cpu_blocks=8, store_threshold=2, store_threshold_scope=scope,
                mutant=mutant)
    try:
        h.add_request(tuple(range(10, 16)), 3)
        h.drain()
        h.engine.reset_prefix_cache()
        h.add_request(tuple(range(10, 17)), 3)
        found: list[str] = []
        while h.engine.has_work:
            h.engine.step()
            h.settle()
            found += h.violations()
        return found + h.final_violations(), h.connector.scheduler.stats
    finally:
        h.close()


@pytest.mark.parametrize("scope", get_args(ThresholdScope))
def test_a_skipped_block_is_never_stored_on_the_reference_engine(scope: ThresholdScope) -> None:
    found, stats = offered_once_then_twice(None, scope)
    assert found == []
    assert stats.blocks_skipped_threshold == 3 and stats.blocks_stored == 3


@pytest.mark.parametrize("scope", get_args(ThresholdScope))
def test_control_a_skip_recorded_but_not_applied_is_caught(scope: ThresholdScope) -> None:
    found, _ = offered_once_then_twice("skip-not-applied", scope)
    assert any(line.startswith("skipped-not-stored: ") for line in found), found
