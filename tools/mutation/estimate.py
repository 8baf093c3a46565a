"""What a mutmut run over some modules will cost, from a stats run's `mutants/mutmut-stats.json`: per module, its
mutants, those no selected test reaches, and the test time (the `call` phase of each test that reaches the
mutant's function, as mutmut times it) a mutant costs if it survives; a killed one stops at its first failing test.

Usage (from the repository root): `python tools/mutation/estimate.py [PREFIX...] [--stats FILE]`, e.g.
`python tools/mutation/estimate.py kvfsm.tiers kvfsm.mooncake --stats stats.json` (the file a narrowed device run
returns). Fixture setup (a module's `mooncake_master`, say) and pytest's own start are not in the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from tally import verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", metavar="PREFIX", help="modules to count (all when none)")
    parser.add_argument("--stats", type=Path, default=Path("mutants/mutmut-stats.json"))
    args = parser.parse_args()
    stats = json.loads(args.stats.read_text())
    tests_by_function = stats["tests_by_mangled_function_name"]
    seconds = stats["duration_by_test"]
    rows: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    worst: dict[str, float] = collections.defaultdict(float)
    for name in verdicts(Path.cwd()):
        if args.prefixes and not name.startswith(tuple(args.prefixes)):
            continue
        module = name.split(".x")[0]
        tests = tests_by_function.get(name.partition("__mutmut_")[0], [])
        cost = sum(seconds.get(test, 0.0) for test in tests)
        rows[module]["mutants"] += 1
        rows[module]["no tests"] += not tests
        rows[module]["survivor seconds"] += cost
        worst[module] = max(worst[module], cost)
    total = collections.Counter()
    print(f"{'module':45} {'mutants':>8} {'no tests':>9} {'mean s':>7} {'max s':>7} {'all survive s':>14}")
    for module, row in sorted(rows.items()):
        total.update(row)
        mean = row["survivor seconds"] / max(row["mutants"] - row["no tests"], 1)
        print(f"{module:45} {row['mutants']:8} {row['no tests']:9} {mean:7.2f} {worst[module]:7.1f}"
              f" {row['survivor seconds']:14.0f}")
    print(f"{'total':45} {total['mutants']:8} {total['no tests']:9} {'':7} {'':7} {total['survivor seconds']:14.0f}")


if __name__ == "__main__":
    main()
