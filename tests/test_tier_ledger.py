"""Tier jobs on the connector's ledger, rule by rule: what a write-back's or a fetch's end does to its CPU slots comes
from the couplings `tier-job.yaml` declares (a spec without the coupling leaves the slots where they were), and with
`keep_history` off nothing the connector retains (every structure `kvfsm.testing.census` finds) grows with the number
of tier jobs, whatever their ends (done, failed, abandoned and released, fetched and never loaded)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

from kvfsm.bindings import default_spec
from kvfsm.executor.sim import SimDevice
from kvfsm.tier_records import TierJob
from kvfsm.spec import Spec
from kvfsm.testing.census import census
from kvfsm.testing.harness import Harness
from kvfsm.testing.spec_mutants import load_mutant, running, spec_mutants

A, B = (11, 12, 13, 14), (21, 22, 23, 24)


def _serve(h: Harness, prompt: tuple[int, ...]) -> None:
    h.engine.reset_prefix_cache()
    h.add_request(prompt, 1)
    h.drain()


def _first(h: Harness, kind: str) -> TierJob:
    return next(j for j in h.connector.scheduler.tier_jobs.values() if j.kind == kind)


def _until_ended(h: Harness, job: TierJob) -> None:
    """Step the engine, the device and the disk until the scheduler heard of the job's end."""
    for _ in range(10):
        if not job.in_flight:
            return
        h.engine.step()
        h.settle()
    raise AssertionError(f"tier job {job.job_id} is still {job.state}")


def written_back(h: Harness) -> TierJob:
    """A prompt served; its blocks' eager write-back to disk completed."""
    h.add_request(A + (1,), 1)
    for _ in range(10):
        h.engine.step()
        h.settle()
        if h.connector.scheduler.tier_jobs:
            break
    job = _first(h, "write-back")
    _until_ended(h, job)
    return job


def fetched(h: Harness) -> TierJob:
    """A prompt's blocks only on disk (pushed out of the two-block CPU pool), looked up again: its fetch completed."""
    _serve(h, A + (1,))
    _serve(h, B + (2,))
    h.engine.reset_prefix_cache()
    h.add_request(A + (3,), 1)
    h.engine.step()  # the fetch is ordered and its read submitted
    job = _first(h, "fetch")
    _until_ended(h, job)
    return job


COMPLETIONS: dict[str, tuple[Callable[[Harness], TierJob], str, str]] = {
    "write-back": (written_back, "cpu-block.written-back(write-back-slots)", "writing-back"),
    "fetch": (fetched, "cpu-block.fetch-done(fetch-slots)", "fetching"),
}
"""Per kind: the run that completes one, the coupling of `complete` that moves its slots, where they stay without it."""


def slots_after_completion(kind: str, spec: Spec) -> list[str]:
    """The states of a completed job's CPU slots, the connector's machines built from `spec`."""
    with running(spec):
        h = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4)
    try:
        job = COMPLETIONS[kind][0](h)
        assert job.state == "done"
        return [h.connector.scheduler.manager.blocks[slot].state for slot in job.cpu_slots]
    finally:
        h.close()


@pytest.mark.parametrize("kind", sorted(COMPLETIONS))
def test_a_completed_tier_job_makes_its_cpu_slots_ready_by_the_coupling_tier_job_yaml_declares(
        kind: str, tmp_path: Path) -> None:
    """The control: the same run with that one coupling dropped from the YAML leaves the slots pinned."""
    _, coupling, pinned = COMPLETIONS[kind]
    (mutant,) = [m for m in spec_mutants() if m.name.startswith("tier-job") and " (complete " in m.name
                 and m.name.endswith(f"drop coupling {coupling}")]
    assert set(slots_after_completion(kind, default_spec())) == {"ready"}
    assert set(slots_after_completion(kind, load_mutant(mutant, tmp_path))) == {pinned}


# --- what is retained without history --------------------------------------------------------------------------

ROUNDS = 24
"""Rounds of the workload below; each orders a write-back and a fetch, and ends them a way the round picks."""


def retained(h: Harness) -> Counter[str]:
    """The size of every structure reachable from the connector (`kvfsm.testing.census`): the ledger, its due
    points, the tier planner, the CPU pool, the worker half, the disk tier, its entries and jobs, every record."""
    return census(h.connector)


def round_of_tier_jobs(h: Harness, index: int) -> None:
    """A fresh prefix written back and fetched again; by round: its write-back fails (the key is given up), its
    fetch fails, is abandoned at its deadline and released, is never loaded (the request aborted, the fetched blocks
    evicted), or completes and is loaded."""
    end = index % 4
    prefix = tuple(range(100 + 8 * index, 104 + 8 * index))
    if end == 0:
        h.tier_faults.inject("write-io-error")
    _serve(h, prefix + (1,))
    _serve(h, prefix[::-1] + (2,))  # another prefix: this one leaves the two-block CPU pool
    h.engine.reset_prefix_cache()
    if end == 1:
        h.tier_faults.inject("read-io-error")
    request = h.add_request(prefix + (3,), 1)
    h.engine.step()  # its fetch is ordered and submitted
    if end == 2:
        h.tier_faults.inject("stall")
    if end == 3:
        h.abort(request)
    h.drain()


def grows(h: Harness) -> dict[str, tuple[int, int]]:
    """The containers whose largest size over the last half of the rounds exceeds their largest over the first half:
    (first, last)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for index in range(ROUNDS):
        round_of_tier_jobs(h, index)
        seen = first if index < ROUNDS // 2 else last
        for name, size in retained(h).items():
            seen[name] = max(seen.get(name, 0), size)
    return {name: (first.get(name, 0), size) for name, size in last.items() if size > first.get(name, 0)}


def history_kept(h: Harness) -> None:
    """The ledger's pruning off: ended jobs stay, and failed ones are noted, as with `keep_history`."""
    h.connector.scheduler.ledger.keep_history = True


def gave_up_unbounded(h: Harness) -> None:
    """The tier planner remembers every key whose write-back failed."""
    assert h.connector.scheduler.tiers is not None
    h.connector.scheduler.tiers.gave_up_bound = 1 << 62


@pytest.mark.parametrize(("control", "growing"), [
    (None, set()),
    (history_kept, {"Ledger.tier_jobs", "Ledger.jobs", "Ledger.reported_failed", "TierJob[disk]", "TransferJob"}),
    (gave_up_unbounded, {"TierPlanner._gave_up"}),
])
def test_without_history_nothing_the_connector_retains_grows_with_the_number_of_tier_jobs(
        control: Callable[[Harness], None] | None, growing: set[str]) -> None:
    """The controls break the bound one structure at a time; the check names what grew."""
    h = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=2, disk_slots=4, keep_history=False)
    try:
        if control is not None:
            control(h)
        grown = grows(h)
        assert growing <= set(grown) if growing else grown == {}, f"grew: {grown}"
        assert h.connector.scheduler.tiers is not None and h.connector.scheduler.tiers.stats.failures, \
            "no tier job failed: the workload did not reach the ends it is meant to"
    finally:
        h.close()
