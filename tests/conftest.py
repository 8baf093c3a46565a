"""Hypothesis profiles and the `gpu` marker.

`ci` is registered under the name hypothesis would otherwise fill with its built-in profile when CI=true, so the
project's bounds win. Every profile prints the reproduction blob of a failing example.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest
import torch
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:  # xdist is imported only where its hooks run
    from xdist.remote import Producer
    from xdist.scheduler.protocol import Scheduling

_common = dict(print_blob=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

settings.register_profile("ci", max_examples=60, derandomize=True, **_common)
settings.register_profile("dev", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
settings.register_profile("gpu", max_examples=30, **_common)
settings.register_profile("mutmut", max_examples=8, derandomize=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Every Mooncake tier a test opens reads its tenant secret from the default variable unless the test says otherwise
# (a fixed secret, so that engines in other processes of one test share it).
os.environ.setdefault("KVFSM_MOONCAKE_SECRET", "kvfsm-tests-only-secret-0123456789abcdef")

# The simulator's tensors are tiny: intra-op threads only contend, and on a busy 2-core CI machine they made
# SimDevice runs up to 30x slower.
torch.set_num_threads(1)


SLOW_LAST = ("test_exploration.py", "test_interleavings.py")
"""Under mutmut (which stops at the first failure), the whole-system searches run after the focused tests, so a
mutant a focused test kills costs seconds."""

NOT_UNDER_MUTMUT = ("test_spec_mutants.py", "test_interleavings.py::test_mutant_is_caught[",
                    "test_control_is_caught[", "test_a_long_run_keeps_memory_flat",
                    "test_the_soak_catches_a_connector", "_even_under_python_O", "test_tier_soak.py",
                    "test_mooncake_processes.py", "test_mooncake_bench.py",
                    "test_a_stalled_master_never_stops_the_engine_serving", "test_two_gloo_ranks_",
                    "test_control_every_rank_writes_is_caught_across_processes",
                    "test_with_mla_completing_on_the_first_report_is_caught_with_no_skew_and_no_failing_rank")
"""Skipped under mutmut: tests that mutate the spec or the code themselves (the spec battery, the hand-written
mutants' hunts of up to 1500 examples each, the manager's controls), those that start engine processes (the
`python -O` run, Mooncake's engines in two processes, the replicated-KV runs on two gloo ranks) or soak (100k requests; the failing tiers' five minutes), the
Mooncake bench, and the 30 s stalled-master wait. Each costs minutes per surviving mutant; all run in CI on the
unmutated code. The other Mooncake tests run per mutant (each module starts its own `mooncake_master` on free
ports, so parallel workers do not share one): they judge `kvfsm/mooncake/` and the Mooncake tier."""

FOCUS = {"kvfsm.connector.validation.": ("test_boundaries.py", "test_boundaries_property.py", "test_boundaries_messages.py",
                                         "test_connector_due.py")}
"""Modules whose mutants are judged by their own tests only: a check that refuses bad input is exercised by every
test, but only the boundary tests (and the due points' tests, for the quiet-step fast path) feed it bad input, so
the rest can only make its survivors slow."""


def _skipped_under_mutmut(item: pytest.Item, mutant: str) -> bool:
    if any(part in item.nodeid for part in NOT_UNDER_MUTMUT):
        return True
    focus = next((files for module, files in FOCUS.items() if mutant.startswith(module)), None)
    return focus is not None and item.path.name not in focus


def _run_order(item: pytest.Item, mutant: str) -> tuple[bool, bool]:
    """Under mutmut, the searches last and the tests of a file named after the mutant's module first
    (`test_tiers_disk.py` for `kvfsm.tiers.disk`, `test_executor_rows.py` for `kvfsm.executor.rows`): they kill most
    of its mutants in their first tests, where the engine-wide tests of a Mooncake tier take seconds each."""
    module = mutant.split(".x")[0].rpartition(".")[2]
    return item.path.name in SLOW_LAST, module not in item.path.stem


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mutant = os.environ.get("MUTANT_UNDER_TEST")
    if mutant is not None:
        skip_here = pytest.mark.skip(reason="not rerun per mutant (see NOT_UNDER_MUTMUT and FOCUS)")
        for item in items:
            if _skipped_under_mutmut(item, mutant):
                item.add_marker(skip_here)
        items.sort(key=lambda item: _run_order(item, mutant))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


ONE_WORKER_MODULES = ("tests/mooncake/test_tier_soak.py",)
"""Modules whose tests xdist sends to one worker together: each has a costly module-scoped fixture (the tier soak and
its Mooncake master: about 280 s on CI's 2 cores, before its engines ran on threads), which plain `--dist load` ran
once on every worker it sent a test of the module to."""


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> Scheduling | None:
    """`--dist load` (what `-n` runs), except that each of `ONE_WORKER_MODULES` is one unit of work: xdist's
    scheduling by scope, each test its own scope but for those modules'. (xdist's own `xdist_group` marks do this
    under `--dist loadgroup`, but under pytest 9 they group nothing: xdist renames the node ids through an attribute
    pytest no longer reads.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many workers `-n auto` (pyproject's addopts) starts: one per core this process may run on, or none with
    CUDA, where GPU tests share one device and their timed trials and race controls must not contend."""
    return 0 if torch.cuda.is_available() else len(os.sched_getaffinity(0))
