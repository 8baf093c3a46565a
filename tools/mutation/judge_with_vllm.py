"""Judge mutants by tests mutmut does not select (the `vllm` ones), paying vLLM's import once, not once per mutant.

mutmut's environment (and the device host) has no vLLM, so the adapter's mutants have no tests there. This runs in
vLLM's interpreter, in `mutants/` (mutmut's trampolines, from `tools/mutation/generate.py`):

1. The parent imports pytest, vLLM and the test modules once (they import `vllm_harness`, hence vLLM's scheduler,
   the ~10 s a fresh process would pay per mutant), and runs nothing itself, so every child forks from a process
   that holds no threads' locks.
2. A first child runs the tests clean with `MUTANT_UNDER_TEST=stats`: each trampoline then reports the function it
   guards, and a plugin records which tests reach which function and how long each takes (`mutants/vllm-stats.json`,
   reused by later runs over the same tests). If a test fails unmutated, nothing is judged.
3. Per mutant, a child forked from the parent sets `MUTANT_UNDER_TEST` (the trampolines read it at call time) and
   runs only the tests that reach the mutant's function, stopping at the first failure; a mutant whose function no
   test reaches is `NO TESTS` without a run. A child still running at `--timeout`, or at twice its tests' clean
   duration if that is longer, is killed with its process group, and so is one a single test of which runs past
   twice its clean duration (at least a minute): `TIMEOUT`, counted as killed, the tests did not pass in the time
   they take unmutated.

The test modules are imported before pytest starts, so their asserts are not rewritten: a failure still fails, with
a terser message. `--parallel N` judges N mutants at a time, each in its own child; its threads do little but wait for
their children, so a fork rarely meets a lock another thread holds.

Usage, from the repository root (VLLM_PYTHON: the interpreter that has vLLM):
`$VLLM_PYTHON tools/mutation/judge_with_vllm.py NAMES_FILE TEST_PATH... [--timeout S] [--parallel N] > vllm-verdicts.txt`
(test paths may lie in a subfolder: `tests/mooncake/test_vllm_*.py`, with `mooncake_master` on `PATH`)
then `python tools/mutation/tally.py --judged vllm-verdicts.txt`.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

MUTMUT_WHEEL = Path(".mutwhl/mutmut-3.8.1-py3-none-any.whl")
"""The trampolines import mutmut's pure-Python part: unpacked from its wheel, whatever vLLM's Python is."""
PYTEST_ARGS = ["-q", "-x", "--tb=no", "-p", "no:cacheprovider", "-p", "no:unraisableexception", "-n", "0",
               "--hypothesis-profile=mutmut"]
"""`--tb=no` and no `unraisableexception` plugin: a failure's traceback through the mutated modules' long sources
(2.9 s) and that plugin's forced garbage collections at exit (1.2 s) were most of a killed mutant's cost."""
STATS = Path("vllm-stats.json")
"""In `mutants/`: which tests reach which function, and each test's duration, from the clean run."""
CLEAN_TIMEOUT_S = 1800
CLEAN_SLOWDOWN = 2.0
"""A mutant's tests may run this many times as long as they ran clean (or `--timeout`, whichever is longer) before
it is a `TIMEOUT`: a mutant whose tests all pass but take longer than a fixed timeout (a function a hundred tests
reach) would otherwise be counted as killed."""
TEST_DEADLINE_FLOOR_S = 60.0
HUNG_EXIT = 86
"""The exit code of a child one of whose tests ran past its deadline (`TestDeadline`)."""


def prepare(tests: list[str]) -> None:
    """Enter `mutants/`, make mutmut importable, and import pytest, vLLM and the test modules (with their conftest)."""
    site = Path("mutants/.mutmut-site").resolve()
    if not (site / "mutmut").is_dir():
        zipfile.ZipFile(MUTMUT_WHEEL).extractall(site)
    os.chdir("mutants")
    sys.path[:0] = [str(Path("tests").resolve()), str(Path.cwd()), str(site)]
    # a process a test starts (the Mooncake set-up probe's child) needs the caller's packages too (on a device host
    # Mooncake lives on the caller's PYTHONPATH): the mutated code's paths first, then the caller's
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    os.environ.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path[:3] + inherited))
    importlib.import_module("pytest")
    importlib.import_module("conftest")
    for path in sorted({test.split("::")[0] for test in tests}):
        folder = str(Path(path).parent.resolve())  # tests/mooncake/'s modules import by their bare name too
        if folder not in sys.path:
            sys.path.append(folder)
        importlib.import_module(Path(path).stem)


def run_child(mutant: str, args: list[str], timeout_s: float, plugins: list[object] = ()) -> tuple[str, int, str]:
    """pytest over `args` in a forked child with `mutant` under test: ('done', exit code, output) or ('timeout', ...)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        pid = os.fork()
        if pid == 0:  # the child: its own process group, so a timeout also ends what its tests started
            os.setpgid(0, 0)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            from mutmut.mutation import trampoline
            trampoline.set_mutant_under_test(mutant)
            import pytest
            code = 1
            try:
                code = int(pytest.main(args, plugins=list(plugins)))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        status = wait_or_kill(pid, timeout_s)
        out.seek(0)
        text = out.read()
    if status is None:
        return "timeout", -1, text
    return "done", os.waitstatus_to_exitcode(status), text


def wait_or_kill(pid: int, timeout_s: float) -> int | None:
    """The child's wait status, or None once it ran `timeout_s` and was killed with its process group."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


class TestDeadline:
    """A pytest plugin for a mutant's run: a test still running `CLEAN_SLOWDOWN` times its clean duration (at least
    `TEST_DEADLINE_FLOOR_S`) ends the child with `HUNG_EXIT`, so a mutant that hangs one test is a `TIMEOUT` at once
    instead of holding a slot for its whole budget."""

    def __init__(self, durations: dict[str, float]) -> None:
        self.durations = durations

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        """At the start of a test's setup, call and teardown (a skipped test's too)."""
        limit = max(TEST_DEADLINE_FLOOR_S, CLEAN_SLOWDOWN * self.durations.get(nodeid, 0.0))
        self.timer = threading.Timer(limit, os._exit, args=(HUNG_EXIT,))
        self.timer.daemon = True
        self.timer.start()

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        self.timer.cancel()


class Reach:
    """A pytest plugin for the stats run: which functions each test reaches (through the trampolines), and its time."""

    def __init__(self, tests: list[str]) -> None:
        self.tests = sorted(tests)
        self.hits: set[str] = set()
        self.tests_by_function: dict[str, list[str]] = collections.defaultdict(list)
        self.duration: dict[str, float] = collections.defaultdict(float)
        from mutmut.mutation import trampoline
        trampoline.record_trampoline_hit = lambda name, caller=None: self.hits.add(name)

    def pytest_runtest_setup(self, item: object) -> None:
        self.hits.clear()

    def pytest_runtest_makereport(self, item: object, call: object) -> None:
        self.duration[item.nodeid] += call.duration  # type: ignore[attr-defined]

    def pytest_runtest_teardown(self, item: object, nextitem: object) -> None:
        for function in self.hits:
            self.tests_by_function[function].append(item.nodeid)  # type: ignore[attr-defined]

    def pytest_sessionfinish(self, session: object, exitstatus: int) -> None:
        STATS.write_text(json.dumps({"tests": self.tests, "sources": sources(self.tests), "duration": self.duration,
                                     "tests_by_function": self.tests_by_function}, indent=1))


def sources(tests: list[str]) -> str:
    """A digest of the test files under `tests` (files or folders): a test added to a file since the last clean run
    must be traced, not left out of every mutant's selection."""
    digest = hashlib.sha256()
    for path in sorted(tests):
        for file in sorted(Path(path).rglob("*.py")) if Path(path).is_dir() else [Path(path)]:
            digest.update(str(file).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def stats(tests: list[str]) -> dict:
    """The clean run's reach, run now unless `mutants/vllm-stats.json` holds it for these tests as they read now."""
    if STATS.exists() and (known := json.loads(STATS.read_text()))["tests"] == sorted(tests) \
            and known.get("sources") == sources(tests):
        return known
    state, code, text = run_child("stats", PYTEST_ARGS + tests, CLEAN_TIMEOUT_S, [Reach(tests)])
    if state != "done" or code != 0:
        sys.exit(f"the tests fail unmutated ({state}, exit code {code}):\n{text[-4000:]}")
    return json.loads(STATS.read_text())


def verdict(name: str, reach: dict, timeout_s: float) -> str:
    """One line of the verdicts file, as `tally.py --judged` reads it."""
    function = name.rsplit("__mutmut_", 1)[0]
    tests = sorted(reach["tests_by_function"].get(function, []), key=lambda test: reach["duration"][test])
    if not tests:
        return f"NO TESTS {name}"
    clean_s = sum(reach["duration"][test] for test in tests)
    state, code, text = run_child(name, PYTEST_ARGS + tests, max(timeout_s, CLEAN_SLOWDOWN * clean_s),
                                  [TestDeadline(reach["duration"])])
    if state == "timeout" or code == HUNG_EXIT:
        return f"TIMEOUT  {name}"
    if code == 0:
        return f"SURVIVED {name}"
    failed = next((line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))), f"exit code {code}")
    return f"KILLED   {name} | {failed}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", type=Path, help="a file of mutant names, one a line")
    parser.add_argument("tests", nargs="+", help="test paths, from the repository root (tests/test_vllm_x.py)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds one mutant's tests may run")
    parser.add_argument("--parallel", type=int, default=1, help="mutants judged at a time (one child each)")
    args = parser.parse_args()
    names = args.names.read_text().split()
    prepare(args.tests)
    reach = stats(args.tests)

    def timed(name: str) -> str:
        started = time.monotonic()
        return f"{verdict(name, reach, args.timeout)}  [{time.monotonic() - started:.1f} s]"

    with ThreadPoolExecutor(args.parallel) as pool:  # each verdict as it comes: a run cut short keeps what it judged
        for done in as_completed([pool.submit(timed, name) for name in names]):
            print(done.result(), flush=True)


if __name__ == "__main__":
    main()
