"""mutmut 3.8.1's mutant generation alone, the first phase of `mutmut run`: `mutants/` and its `.meta` files, each
mutant not yet judged, without the minutes of the stats run; then the count per module.

Usage (from the repository root): `python tools/mutation/generate.py [PROCESSES]`. A mutant already judged keeps its
verdict unless its function changed; `python tools/mutation/tally.py --counts-only` prints the counts again.
"""

import os
import subprocess
import sys
from pathlib import Path

from mutmut.__main__ import (
    copy_also_copy_files,
    copy_src_dir,
    create_mutants,
    setup_source_paths,
)
from mutmut.mutation.trampoline import set_mutant_under_test


def main() -> None:
    processes = int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count() or 1
    set_mutant_under_test("mutant_generation")
    Path("mutants").mkdir(exist_ok=True)
    copy_src_dir()
    copy_also_copy_files()
    setup_source_paths()
    print(create_mutants(processes))
    subprocess.run([sys.executable, str(Path(__file__).with_name("tally.py")), "--counts-only"], check=True)


if __name__ == "__main__":
    main()
