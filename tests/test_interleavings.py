"""Generated interleavings: kvfsm passes them all; each mutant is caught by some interleaving."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvfsm.machines import IllegalTrigger, default_machines
from kvfsm.mooncake import available as mooncake_available
from kvfsm.testing import policy_controls, tier_mutants, tier_soak
from kvfsm.testing.coverage import declared_edges
from kvfsm.testing.interleavings import EXERCISED, EXTERNAL, STEP_DRIVEN, interleavings_for
from kvfsm.testing.mutants import IDLE_CONTROLS, MUTANTS, TP_CONTROLS, TP_MUTANTS, TP_WORKER_CONTROLS


def test_every_spec_trigger_has_a_driver() -> None:
    spec = default_machines().spec
    triggers = {(name, t) for name, lc in spec.lifecycles.items() for t in lc.triggers}
    assert triggers - STEP_DRIVEN - set(EXTERNAL) == set(), "a spec trigger no rule or engine step provokes"
    assert (STEP_DRIVEN | set(EXTERNAL)) - triggers == set(), "a driver for a trigger the spec no longer has"


def test_kvfsm_passes_generated_interleavings() -> None:
    """kvfsm's own run gets five times the profile's examples: it is the one that must find nothing."""
    run_state_machine_as_test(interleavings_for(None), settings=settings(settings(), max_examples=5 * settings().max_examples))
    declared = declared_edges(default_machines().spec)
    print(f"\ninterleavings exercised {len(EXERCISED & declared)} of {len(declared)} declared transitions; "
          f"not reached: {sorted(declared - EXERCISED)}")


COVERAGE_EXAMPLES = 600
"""Derandomized examples the coverage run takes, whatever the profile: the same examples every run."""

SESSION_11_DRAW = (": the draws of recent commits made one; this one, reshuffled when a load's separate end record "
                   "went (session 11), does not")

NOT_GENERATED = {
    ("request", "loading", "job-done", "loading"): "needs a flushed store reported while its request loads",
    ("request", "matched", "job-done", "matched"):
        "needs a request looked up again (matched) while one of its own stores is still in flight, then that store "
        "reported: the draws before standing-deferral made one; this one, reshuffled when a deferral began to stand "
        "until one of its jobs ends, does not; a run of tests/test_tensor_parallel.py's generated interleavings "
        "took it (not every draw does)",
    ("request", "returned", "job-done", "returned"):
        "needs one of an ended request's stores reported while another is still in flight (as draining's job-done "
        "did before lazy-fence: met by some draws, not by this one); tests/test_connector_scheduler_lifetime.py's "
        "step that hands out a freed block takes it",
    ("request", "matched", "abort", "returned"):
        "needs an abort between the lookup and the allocation of a request with a store still in flight (a preempted "
        "request whose store is still copying, looked up again): the draws of recent commits made one (to draining, "
        "before lazy-fence); this one does not",
    ("request", "draining", "load-failed", "released"):
        f"an aborted request whose load then fails{SESSION_11_DRAW}; tests/test_tier_scenarios.py's abort before an "
        "inline load is reported takes it",
    ("request", "deferred", "abort", "returned"):
        "an abort of a deferred request with a store still in flight (a preempted request whose store still copies, "
        f"looked up again){SESSION_11_DRAW}; tests/test_connector_scheduler.py's request aborted while deferred "
        "behind its own store takes it",
    ("cpu-block", "writing-back", "abandon-write-back", "orphaned"):
        "a stall while a write-back to disk is in flight: this draw makes one when the file runs alone but not in "
        "the whole suite's order (a Mooncake tier's replies arrive in real time, so the draws after one can differ); "
        "tests/test_tier_planner_engine.py's abandoned write-back takes it",
    ("cpu-block", "fetching", "fetch-failed", "free"):
        "a fetch from disk that fails (return_from_disk's read-io-error or corrupt-block): the draws of recent "
        "commits made one; this one, reshuffled when a step's stores became one pipeline of device operations, "
        "does not; tests/test_tiers_disk.py's fault table takes it",
    ("cpu-block", "fetching", "abandon-fetch", "orphaned"):
        "a stall while a fetch from disk is in flight: return_from_disk's stall fault makes one, which this "
        "derandomized draw does not pick with a key only on disk; the explorer's disk-stall workload takes it in "
        "every schedule, tests/test_tiers_disk.py in its fault table",
    **{("cpu-block", "orphaned", f"abandon-{kind}", "orphaned"):
       f"a cache reset while a {kind} is in flight, then a stall past its deadline: tests/test_tiers_disk.py's fault "
       f"table ({kind}-then-stall) and tests/test_spec_mutants.py's reset-then-stall-{kind} take it"
       for kind in ("fetch", "write-back")},
    ("request", "loading-inline", "load-failed", "running"):
        "an inline load that fails under a running request: this draw makes none; tests/test_spec_mutants.py's "
        "failed_store_and_loads with layer_loads takes it, and tests/test_vllm_inline.py under vLLM",
    ("request", "running", "slide", "running"):
        "kvfsm's own engine has no sliding-window KV-cache groups; the vLLM adapter fires it under vLLM's hybrid "
        "allocator, and tests/test_vllm_groups.py takes it",
    ("request", "loading-inline", "finish", "draining"):
        "kvfsm's engine does not finish a request whose inline load is unreported; vLLM's scheduler does (in the "
        "output of the load's step, before it reads the step's reports), and tests/test_vllm_inline.py takes it",
    ("gpu-block", "freed-while-read", "free", "freed-while-read"):
        "a block freed while stores read it, freed again by another request holding it: kvfsm's run under the ci "
        "profile takes it; this draw, reshuffled when the set-up began drawing back-pressure bounds and one-slot "
        "pools, does not",
}
"""Declared transitions the generated interleavings do not take within COVERAGE_EXAMPLES, each with what it needs."""


COVERAGE_CHILD = "KVFSM_COVERAGE_CHILD"
"""Set in the fresh interpreter the coverage test starts: there it runs the examples itself."""


def test_generated_interleavings_take_every_declared_transition() -> None:
    """Run in a fresh interpreter: the derandomized examples are the same every run only in a process no earlier
    test has touched (in a whole-suite worker, what earlier tests left behind changed which transitions the same
    600 examples took)."""
    if os.environ.get(COVERAGE_CHILD):
        EXERCISED.clear()
        run_state_machine_as_test(interleavings_for(None), settings=settings(
            settings(), max_examples=COVERAGE_EXAMPLES, derandomize=True, database=None))
        declared = declared_edges(default_machines().spec)
        assert EXERCISED - declared == set(), "a transition the spec does not declare"
        assert declared - EXERCISED <= set(NOT_GENERATED), "a declared transition no generated example takes"
        return
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--hypothesis-profile=ci",
         f"{__file__}::test_generated_interleavings_take_every_declared_transition"],
        env={**os.environ, COVERAGE_CHILD: "1"}, capture_output=True, text=True, timeout=1800)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]


MUTANT_BUDGET = 1500
"""Examples a mutant may survive; kvfsm's own run uses the profile's count. No shrinking: finding is enough. The
rarest catch, `partial-load-report` (compute drawn between a load's first and last layer landing), had a budget of
8,000 of its own (caught after 542 examples alone, about 3,000 in a whole-suite run, none in 1,500 in another); its
hunt now gets `lag_a_load` (`Mutant.load_lags`), and catches it after 6 examples under `ci` (under 8 hash seeds
alike) and after 8 to 274 (median about 65) in 10 random runs."""


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_is_caught(mutant: str) -> None:
    if MUTANTS[mutant].tier == "mooncake" and not mooncake_available():
        pytest.skip("Mooncake is not installed")
    machine = interleavings_for(mutant)
    hunt = settings(settings(), max_examples=MUTANT_BUDGET, phases=[Phase.generate],
                    report_multiple_bugs=False, print_blob=False, database=None)
    with pytest.raises((AssertionError, IllegalTrigger)) as caught:
        run_state_machine_as_test(machine, settings=hunt)
    first_line = str(caught.value).splitlines()[0]
    print(f"\n{mutant} ({MUTANTS[mutant].breaks}): caught after {machine.examples} examples: {first_line}")


CONTROL_REGISTRIES = {
    "MUTANTS": MUTANTS, "TP_MUTANTS": TP_MUTANTS, "TP_CONTROLS": TP_CONTROLS, "TP_WORKER_CONTROLS": TP_WORKER_CONTROLS,
    "TIER_RANK_CONTROLS": tier_mutants.TIER_RANK_CONTROLS, "MULTI_TIER_CONTROLS": tier_mutants.MULTI_TIER_CONTROLS,
    "REPLICATED_TIER_CONTROLS": tier_mutants.REPLICATED_TIER_CONTROLS, "ROOM_CONTROLS": tier_mutants.ROOM_CONTROLS,
    "DISK_FILE_MUTANTS": {name: apply for name, _, apply in tier_mutants.DISK_FILE_MUTANTS},
    "policy CONTROLS": policy_controls.CONTROLS, "soak CONTROLS": tier_soak.CONTROLS,
    "PLAN_CONTROLS": tier_mutants.PLAN_CONTROLS, "IDLE_CONTROLS": IDLE_CONTROLS,
}
"""Every registry of controls in `kvfsm.testing`: each control in one is kvfsm with one rule removed."""


def test_every_control_of_every_registry_is_named_in_the_docs() -> None:
    """A reader looking for what breaks a rule finds each control by name (in backticks) in docs/."""
    docs = " ".join(page.read_text() for page in (Path(__file__).parent.parent / "docs").glob("*.md"))
    unnamed = {f"{registry}: {name}" for registry, controls in CONTROL_REGISTRIES.items() for name in controls
               if f"`{name}`" not in docs}
    assert unnamed == set()
