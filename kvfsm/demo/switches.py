"""The demo's switches that break a rule on purpose, so a user can watch the checks catch it: `--mutant` (a
guarded rule removed from the engine or connector), and `python -m kvfsm.tp`'s `--control` (a scheduler half that
breaks a tensor-parallel rule), `--failing-rank` (one rank's copies failing now and then) and `--skewed-rank` (one
rank's reports arriving late).

The breaks themselves are test code (`kvfsm.testing`, where the suite's mutants live); this module is the one
place the product reaches for them: the import contract "Product code imports nothing from kvfsm.testing" names it
as its only exception.
"""

from __future__ import annotations

from kvfsm.testing.copy_faults import EveryNthFails
from kvfsm.testing.mutants import MUTANTS, TP_CONTROLS
from kvfsm.testing.rank_skew import LateReports

__all__ = ["MUTANTS", "TP_CONTROLS", "EveryNthFails", "LateReports"]
