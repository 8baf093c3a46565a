"""The mutation score: mutmut's verdicts (`mutants/**/*.meta`) joined with the answers in `docs/mutants.md`.

A mutant that `judge_on_gpu.sh` or `judge_with_vllm.py` (tests mutmut does not select: the `gpu` and `vllm` ones)
reports `KILLED` or `TIMEOUT` in a verdicts file passed with `--judged` counts as killed. Each other surviving mutant
(and each with no CPU test) must have a line in `docs/mutants.md`:
`equivalent` (no behaviour can differ: left out of the score), `killed outside mutmut's selection` or `killed on
the GPU` (a test mutmut does not select fails on it: counted as killed), or `left` (not killed). A survivor with
no line counts as not killed. Timeouts and crashes (segfault) count as killed: the tests failed.

Usage: `python tools/mutation/tally.py [--counts-only] [--unanswered] [--scope PREFIX...] [--judged FILE...]` from
the repository root, after a run; `--scope kvfsm.tiers kvfsm.mooncake` counts only the mutants of those modules.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

from mutmut.__main__ import status_by_exit_code

ANSWER = re.compile(r"^- `(?P<name>kvfsm\.[^`]+)` — (?P<verdict>equivalent|killed outside mutmut's selection|"
                    r"killed on the GPU|left)")
COUNTED_KILLED = ("killed outside mutmut's selection", "killed on the GPU")
JUDGED = re.compile(r"^(?P<verdict>KILLED|TIMEOUT|SURVIVED|NO TESTS) +(?P<name>kvfsm\.\S+)")
"""A line of `judge_on_gpu.sh` or `judge_with_vllm.py`'s output."""


def verdicts(root: Path) -> dict[str, str]:
    """mutant name -> mutmut's status ('killed', 'survived', 'no tests', 'timeout', 'not checked')."""
    found = {}
    for meta in (root / "mutants").glob("**/*.meta"):
        for name, code in json.loads(meta.read_text()).get("exit_code_by_key", {}).items():
            found[name] = "not checked" if code is None else status_by_exit_code.get(code, "not checked")
    return found


def judged_elsewhere(files: list[Path]) -> dict[str, str]:
    """mutant name -> 'killed' or 'survived' by the tests a judge script ran (the last line of a name wins; a mutant
    no test of the script's reaches survived them)."""
    found = {}
    for path in files:
        for line in path.read_text().splitlines():
            if m := JUDGED.match(line):
                found[m["name"]] = "survived" if m["verdict"] in ("SURVIVED", "NO TESTS") else "killed"
    return found


def answers(doc: Path) -> dict[str, str]:
    """mutant name -> the verdict its line in `docs/mutants.md` gives."""
    return {m["name"]: m["verdict"] for line in doc.read_text().splitlines() if (m := ANSWER.match(line))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts-only", action="store_true", help="mutmut's own counts, per module")
    parser.add_argument("--unanswered", action="store_true", help="list survivors with no line in the doc")
    parser.add_argument("--scope", nargs="+", default=[], metavar="PREFIX",
                        help="count only mutants whose module starts with one of these (kvfsm.tiers ...)")
    parser.add_argument("--judged", nargs="+", default=[], type=Path, metavar="FILE",
                        help="verdicts of judge_on_gpu.sh / judge_with_vllm.py for mutants mutmut did not kill")
    parser.add_argument("--names", metavar="STATUS",
                        help="print only the names with this status ('not checked': a next run's @file)")
    args = parser.parse_args()
    root = Path.cwd()
    found = {name: status for name, status in verdicts(root).items()
             if not args.scope or name.startswith(tuple(args.scope))}
    if args.names:
        print("\n".join(sorted(name for name, status in found.items() if status == args.names)))
        return
    elsewhere = judged_elsewhere(args.judged)
    per_module: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for name, status in found.items():
        per_module[name.split(".x")[0]][status] += 1
    print(dict(collections.Counter(found.values())))
    for module, counts in sorted(per_module.items()):
        print(f"  {module}: {dict(counts)}")
    if args.counts_only:
        return
    given = answers(root / "docs" / "mutants.md")
    score: collections.Counter[str] = collections.Counter()
    unanswered = []
    for name, status in found.items():
        if status in ("killed", "timeout", "segfault"):
            score["killed"] += 1
        elif elsewhere.get(name) == "killed":
            score["killed"] += 1
            score["killed by a judge script"] += 1
        elif status == "not checked" and name not in elsewhere:
            score["not run"] += 1
        elif given.get(name) == "equivalent":
            score["equivalent"] += 1
        elif given.get(name) in COUNTED_KILLED:
            score["killed"] += 1
            score[given[name]] += 1
        else:
            score["not killed"] += 1
            if name not in given:
                unanswered.append(name)
    judged = score["killed"] + score["not killed"]
    print(dict(score))
    print(f"killed {score['killed']} of {judged} non-equivalent judged mutants: {score['killed'] / max(judged, 1):.1%}")
    stale = sorted(name for name in set(given) - set(found) if not args.scope or name.startswith(tuple(args.scope)))
    if stale:
        print(f"{len(stale)} lines of docs/mutants.md name no current mutant (renumbered?): {stale[:5]} ...")
    if args.unanswered:
        print("\n".join(sorted(unanswered)))


if __name__ == "__main__":
    main()
