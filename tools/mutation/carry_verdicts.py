"""Carry an older run's verdicts over to today's mutants, for the mutants whose code has not changed since.

Mutmut numbers a function's mutants anew whenever the function changes, and a run's verdicts live only in its
`mutants/` folder (`*.meta`), which `generate.py` replaces. A verdict still holds for today's mutant of the same name
when the mutated function reads exactly as it did in that run (the mutants are generated from the same source by
the same mutmut, so the same code under the same name is the same mutant). Mutants whose function changed are left
out: they need judging again. Output: one `KILLED` / `TIMEOUT` / `SURVIVED` / `NO TESTS` line per carried mutant,
the format `tally.py --judged` reads. Later tests only add kills, so a carried `SURVIVED` may be killed by now: the
tally counts it as not killed until a later verdicts file (or docs/mutants.md) says otherwise.

Usage: `python tools/mutation/carry_verdicts.py OLD_ROOT [--scope PREFIX...] > verdicts/NAME.txt`, from the
repository root after `python tools/mutation/generate.py` (today's mutants in `./mutants`); OLD_ROOT holds the
older run's `mutants/` folder.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from tally import verdicts

LINE = {"killed": "KILLED  ", "timeout": "TIMEOUT ", "survived": "SURVIVED", "no tests": "NO TESTS",
        "segfault": "KILLED  "}
"""How each of mutmut's statuses is written in a verdicts file (a crash failed the tests: killed)."""


def mutant_sources(module_file: Path) -> dict[str, str]:
    """Each mutant function of one generated module (`x_f__mutmut_3`, `xǁClassǁm__mutmut_3`), as normalised source."""
    tree = ast.parse(module_file.read_text())
    return {node.name: ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "__mutmut_" in node.name}


def carried(old_root: Path, new_root: Path, scope: tuple[str, ...]) -> list[str]:
    """The verdict lines of `old_root`'s run for the mutants in `scope` that read the same in `new_root`."""
    lines, sources = [], {}
    for name, status in verdicts(old_root).items():
        module, function = name.rsplit(".", 1)
        relative = Path(*module.split(".")).with_suffix(".py")
        if not (old_root / "mutants" / relative).exists():  # a package's own module
            relative = relative.with_suffix("") / "__init__.py"
        if status not in LINE or not name.startswith(scope) or not (new_root / "mutants" / relative).exists():
            continue
        if relative not in sources:
            sources[relative] = (mutant_sources(old_root / "mutants" / relative),
                                 mutant_sources(new_root / "mutants" / relative))
        old_code, new_code = sources[relative]
        if function in old_code and old_code[function] == new_code.get(function):
            lines.append(f"{LINE[status]} {name}")
    return sorted(lines, key=lambda line: line.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_root", type=Path, help="the folder holding the older run's mutants/")
    parser.add_argument("--scope", nargs="+", default=["kvfsm."], help="module prefixes to carry (kvfsm.tiers ...)")
    args = parser.parse_args()
    sys.stdout.write("".join(f"{line}\n" for line in carried(args.old_root, Path("."), tuple(args.scope))))


if __name__ == "__main__":
    main()
