"""A Mooncake tier's faults under vLLM's real Scheduler, on a real `mooncake_master`: each ends as a miss or a
recompute, with 0 bytes wrong and no exception reaching vLLM. The master killed mid-run (and restarted: hits resume),
a full store, a key the store dropped between the scheduler's lookup and the worker's read, a corrupted value, and a
master that stops answering (a lookup costs at most its bound: never a stalled scheduling step).
Each is produced in the real store, each run is traced, checked after every step and drained, and each has a
control with its rule removed that the same test catches. Skipped when vLLM or Mooncake is not installed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")

import kvfsm.tiers.mooncake as mooncake_module  # noqa: E402
from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.mooncake.errors import TierFault  # noqa: E402
from kvfsm.mooncake.local import LocalMooncake  # noqa: E402
from kvfsm.testing.mooncake_store import MooncakeFaults, unchecked_fetch  # noqa: E402
from kvfsm.testing.tier_mutants import failed_fetch_loads  # noqa: E402
from kvfsm.tiers.mooncake import MooncakeTier  # noqa: E402
from test_vllm_mooncake_tier import mooncake_tier  # noqa: E402
from test_vllm_tier_faults import (  # noqa: E402
    adopt_failed_write_backs,
    on_scheduler,
    recomputed_with_no_wrong_byte,
    tier_stats,
)
from test_vllm_tiers import BLOCK_SIZE, MAX_STEPS, PREFIX, fetches, holds_prefix, prefix_keys  # noqa: E402
from test_vllm_tiers import evict_from_cpu_then_reload, push_below_cpu, tiered  # noqa: E402
from vllm_harness import AdapterWorker, Driver  # noqa: E402
from vllm_support import loads_of, model  # noqa: E402,F401

__all__ = ["model", "tiered"]
"""Fixtures used here, defined beside the vLLM tests."""

pytestmark = pytest.mark.vllm

QUICK = {"op_timeout_s": 1.0, "lookup_timeout_s": 0.1, "retry_after_s": 0.2}
"""A dead master is noticed within a second, and asked again 0.2 s later."""
REMOUNT_S = 30.0
"""Bound on the wait for the segment host to lend its memory to a restarted master."""


def worker_store(worker: AdapterWorker) -> MooncakeTier:
    (tier,) = worker.connector.worker_side.kvfsm.lower_tiers
    assert isinstance(tier, MooncakeTier)
    return tier


def span(start: int) -> list[int]:
    """A prefix of four blocks no other prompt here shares."""
    return list(range(start, start + 4 * BLOCK_SIZE))


# --- the master killed mid-run, then restarted -----------------------------------------------------------------


def wait_until_the_store_serves(tier: MooncakeTier) -> None:
    """The restarted master knows no segment until the segment host mounted its memory again."""
    deadline = time.monotonic() + REMOUNT_S
    while tier.client.raw().put("kvfsm-probe", b"x") != 0:
        assert time.monotonic() < deadline, "the store never served again after the restart"
        time.sleep(0.05)


def killed_then_restarted(tiered, deployment: LocalMooncake) -> tuple[Driver, AdapterWorker]:
    """PREFIX written back, the master killed, a reader of PREFIX served meanwhile; the master restarted (empty), a
    second prefix written back and read back through it. The driver and its worker."""
    d, (worker,) = tiered(mooncake_tier(deployment, "tiny-killed", **QUICK))
    push_below_cpu(d, [worker])
    deployment.kill_master()
    d.add("reader", PREFIX + [9])
    d.run(MAX_STEPS)
    deployment.restart_master()
    wait_until_the_store_serves(worker_store(worker))
    push_below_cpu(d, [worker], span(5000), [span(6000), span(7000), span(8000)], tag="after-")
    d.add("after-reader", span(5000) + [9])
    d.run(MAX_STEPS)
    return d, worker


def test_a_killed_master_costs_misses_and_a_restarted_one_serves_hits_again(tiered, fresh_mooncake) -> None:
    d, worker = killed_then_restarted(tiered, fresh_mooncake)
    stats = tier_stats(d)
    assert fetches(d)[0].keys == tuple(prefix_keys(d, PREFIX))
    assert stats.failures["io-error"] + stats.failures["timeout"] > 0, "the dead master's fetch did not fail"
    assert not loads_of(d, "reader")
    recomputed_with_no_wrong_byte(d, worker)
    (load,) = loads_of(d, "after-reader")
    assert holds_prefix(worker, load, span(5000))
    assert stats.tokens_loaded_from["mooncake"] == len(span(5000)), "no hit after the restart"


def test_control_a_tier_that_lets_a_dead_masters_error_out_reaches_vllm(
        tiered, fresh_mooncake, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule: a store fault is a failed key. A tier that reads the dead master's errors as bugs raises them out
    of the worker's step, which the test above would see."""
    monkeypatch.setattr(mooncake_module, "failure_of", lambda fault: None)
    with pytest.raises((TierFault, ExceptionGroup)) as raised:  # a group when several keys failed at once
        killed_then_restarted(tiered, fresh_mooncake)
    error = raised.value
    assert isinstance(error, TierFault) or error.subgroup(TierFault) is not None


# --- a full store ----------------------------------------------------------------------------------------------


def fill(deployment: LocalMooncake, connect) -> None:
    """Hard-pinned objects take every byte the segment host lends: no put fits until they go."""
    from mooncake.store import ReplicateConfig

    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    hog = connect(deployment).raw()
    codes = [hog.put(f"hog-{i}", bytes(4 << 20), pinned) for i in range(32)]
    codes += [hog.put(f"hog-small-{i}", bytes(64 << 10), pinned) for i in range(64)]
    assert any(code != 0 for code in codes), "the store never filled"


def full_store_then_reload(tiered, deployment: LocalMooncake, connect) -> tuple[Driver, AdapterWorker]:
    fill(deployment, connect)
    d, (worker,) = tiered(mooncake_tier(deployment, "tiny-full", **QUICK))
    evict_from_cpu_then_reload(d, [worker])
    return d, worker


def test_a_full_store_fails_its_write_backs_and_the_reader_recomputes(tiered, fresh_mooncake, connect) -> None:
    d, worker = full_store_then_reload(tiered, fresh_mooncake, connect)
    stats = tier_stats(d)
    assert stats.failures["full"] > 0 and not fetches(d) and not loads_of(d, "reader")
    recomputed_with_no_wrong_byte(d, worker)


def test_control_an_index_that_publishes_a_write_back_the_full_store_refused_is_caught(
        tiered, fresh_mooncake, connect, monkeypatch: pytest.MonkeyPatch) -> None:
    adopt_failed_write_backs(monkeypatch)
    with pytest.raises(SpecViolation, match="publish-after-write.*no write-back of it ended on every rank"):
        full_store_then_reload(tiered, fresh_mooncake, connect)


# --- a key dropped between the lookup and the fetch ------------------------------------------------------------


def drop_at_the_fetch(tier: MooncakeTier) -> None:
    """The store drops each key of a fetch just before the worker reads it (its eviction, an expired lease): the
    scheduler's lookup counted it, the worker's read misses it."""
    submit = tier.submit_read

    def dropped_then_read(job_id: int, keys: Any, destinations: Any) -> None:
        store = tier.client.raw()
        for name in (name for key in keys for name in tier.store_keys(key)):
            store.remove(name, True)
        submit(job_id, keys, destinations)

    tier.submit_read = dropped_then_read  # type: ignore[method-assign]


def dropped_before_its_fetch(tiered, deployment: LocalMooncake, model_id: str,
                             control: Callable[[Driver], None] = lambda d: None) -> Driver:
    d, (worker,) = tiered(mooncake_tier(deployment, model_id, **QUICK))
    control(d)
    drop_at_the_fetch(worker_store(worker))
    evict_from_cpu_then_reload(d, [worker])
    return d


def test_a_key_the_store_dropped_after_the_lookup_fails_its_fetch_and_the_reader_recomputes(
        tiered, mooncake) -> None:
    d = dropped_before_its_fetch(tiered, mooncake, "tiny-dropped")
    assert len(fetches(d)) == 1, "the index offered the dropped keys again"
    assert tier_stats(d).failures["missing"] > 0 and not loads_of(d, "reader")
    recomputed_with_no_wrong_byte(d, d.worker)  # type: ignore[arg-type]


def test_control_a_failed_mooncake_fetch_whose_slots_are_loaded_anyway_is_caught(tiered, mooncake) -> None:
    with pytest.raises(SpecViolation, match="fetch-lands-private|lost-key-is-miss"):
        dropped_before_its_fetch(tiered, mooncake, "tiny-dropped-control",
                                 lambda d: failed_fetch_loads(None, on_scheduler(d)))  # type: ignore[arg-type]


# --- a corrupted value -----------------------------------------------------------------------------------------


def corrupted_then_reload(tiered, deployment: LocalMooncake, model_id: str, checked: bool = True
                          ) -> tuple[Driver, AdapterWorker]:
    """Every value of PREFIX in the store gets a flipped byte (another writer's bytes under its key)."""
    d, (worker,) = tiered(mooncake_tier(deployment, model_id, **QUICK))
    tier = worker_store(worker)
    if not checked:
        unchecked_fetch(None, SimpleNamespace(worker=worker.connector.worker_side.kvfsm))  # type: ignore[arg-type]
    faults = MooncakeFaults(tier)

    def corrupt_prefix() -> None:
        published = sorted(entry.key for entry in tier.entries)  # the order `MooncakeFaults` picks from
        for key in prefix_keys(d, PREFIX):
            faults.corrupt_value(published.index(key))

    evict_from_cpu_then_reload(d, [worker], corrupt_prefix)
    assert faults.corrupted == set(prefix_keys(d, PREFIX))
    return d, worker


def test_a_corrupted_value_fails_its_fetch_and_the_reader_recomputes(tiered, mooncake) -> None:
    d, worker = corrupted_then_reload(tiered, mooncake, "tiny-corrupt")
    stats = tier_stats(d)
    assert fetches(d) and stats.failures["corrupt"] > 0 and stats.tokens_loaded_from["mooncake"] == 0
    assert not loads_of(d, "reader")
    recomputed_with_no_wrong_byte(d, worker)


def test_control_a_tier_that_loads_values_unchecked_serves_the_corrupted_bytes(tiered, mooncake) -> None:
    d, worker = corrupted_then_reload(tiered, mooncake, "tiny-corrupt-control", checked=False)
    (load,) = loads_of(d, "reader")
    assert not holds_prefix(worker, load)


# --- a stalled master ------------------------------------------------------------------------------------------


STEP_BOUND_S = QUICK["lookup_timeout_s"] + 0.5
"""The longest a scheduling step may take while the master does not answer: the lookup's bound, and slack for a
busy machine."""


def slowest_step_while_stalled(tiered, deployment: LocalMooncake, lookup_timeout_s: float | None = None) -> float:
    """Engine A writes PREFIX back; the master stops answering (SIGSTOP); engine B, which must ask the master for
    A's keys, serves a reader of PREFIX. The slowest of B's steps until the reader's first token; then the master
    answers again and B drains. `lookup_timeout_s` overrides the bound on B's master lookups (a control)."""
    tier = mooncake_tier(deployment, "tiny-stalled", **QUICK)
    a, _ = tiered(tier)
    a.add("writer", PREFIX + [1, 2, 3])
    a.run(MAX_STEPS)
    b, _ = tiered(tier)
    b.step()  # B's workers tell its scheduler how they name keys: now it can ask the master
    if lookup_timeout_s is not None:
        master = b.connector.scheduler_side.tier_index.tiers[0].master
        assert master is not None
        master.timeout_s = lookup_timeout_s
    slowest = 0.0
    deployment.pause_master()
    try:
        b.add("reader", PREFIX + [9])
        while "reader" not in b.first_token:
            assert b.step_no < MAX_STEPS, "the reader was never served while the master stalled"
            started = time.monotonic()
            b.step()
            slowest = max(slowest, time.monotonic() - started)
    finally:
        deployment.resume_master()
    b.run(MAX_STEPS)
    assert not loads_of(b, "reader") and b.cpu_pool_drained()
    return slowest


def test_a_stalled_master_costs_a_bounded_miss_never_a_stalled_step(tiered, fresh_mooncake) -> None:
    assert slowest_step_while_stalled(tiered, fresh_mooncake) < STEP_BOUND_S


def test_control_a_lookup_that_waits_longer_for_the_master_stalls_the_step(tiered, fresh_mooncake) -> None:
    assert slowest_step_while_stalled(tiered, fresh_mooncake, lookup_timeout_s=1.0) > STEP_BOUND_S
