"""`mutmut` with its clean-test run skipped: the stats run that precedes it has just run the same tests green.

Usage (from the repository root): `python tools/mutation/run_without_clean_tests.py run [names...]`; any other
mutmut command passes through unchanged (`results`, `show NAME`).

`KVFSM_MUTMUT_TESTS="tests/a.py tests/b/ ..."` narrows the tests mutmut collects its stats from (and so the tests
each mutant is judged by) to those paths, keeping `[tool.mutmut]`'s markers, ignores and deselections: a run over
one part of the code (the tiers, say) then spends no minutes tracing the whole suite. A mutant such a run leaves
alive may still be killed by a test outside the paths; rerun it with the variable unset before answering it.
"""

import os
import sys

import mutmut.workers.isolation as isolation
from mutmut.__main__ import cli
from mutmut.configuration import config

SUITE = "tests"
"""The path in `pytest_add_cli_args_test_selection` that `KVFSM_MUTMUT_TESTS` replaces."""

isolation.ForkServerRunner.run_clean_tests = lambda self, tests: 0


def narrow_selection(paths: list[str]) -> None:
    """Judge by `paths` instead of the whole suite (read before mutmut builds its test runner)."""
    selection = config().pytest_add_cli_args_test_selection
    if SUITE not in selection:
        raise SystemExit(f"[tool.mutmut] pytest_add_cli_args_test_selection has no {SUITE!r} to narrow")
    config().pytest_add_cli_args_test_selection = [arg for arg in selection if arg != SUITE] + paths


if __name__ == "__main__":
    if narrowed := os.environ.get("KVFSM_MUTMUT_TESTS", "").split():
        narrow_selection(narrowed)
    sys.argv = ["mutmut", *sys.argv[1:]]
    cli()
