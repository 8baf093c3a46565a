"""`mutmut` with its clean-test run skipped: the stats run that precedes it has just run the same tests green.

Usage (from the repository root): `python tools/mutation/run_without_clean_tests.py run [names...]`; any other
mutmut command passes through unchanged (`results`, `show NAME`).
"""

import sys

import mutmut.workers.isolation as isolation
from mutmut.__main__ import cli

isolation.ForkServerRunner.run_clean_tests = lambda self, tests: 0

if __name__ == "__main__":
    sys.argv = ["mutmut", *sys.argv[1:]]
    cli()
