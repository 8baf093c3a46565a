"""The layers are one-way: `lint-imports` keeps the contracts in pyproject.toml, and fails when one is bent."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the `kvfsm` package found in `tree`, against the repository's contracts."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", "--config", str(ROOT / "pyproject.toml")],
        cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""}, capture_output=True, text=True, timeout=120,
    )


def test_every_import_contract_is_kept() -> None:
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


BENT_IMPORTS = {
    "executor-imports-a-lifecycle-record": (
        "kvfsm/executor/sim.py", "from kvfsm.records import CpuBlock", "The executor knows streams and bytes",
    ),
    "spec-imports-the-bindings-lazily": (
        "kvfsm/spec.py", "from kvfsm.bindings import default_registry", "The spec knows no runtime",
    ),
    "a-cycle-inside-the-engine": (
        "kvfsm/engine/blocks.py", "from kvfsm.engine.engine import Engine", "No import cycles",
    ),
    "the-adapter-imports-the-test-package": (
        "kvfsm/integrations/vllm/checks.py", "import kvfsm.testing.harness", "Product code imports nothing from",
    ),
    "the-demo-imports-a-mutant-outside-its-switches": (
        "kvfsm/demo/runs.py", "from kvfsm.testing.mutants import MUTANTS", "Product code imports nothing from",
    ),
}


@pytest.mark.parametrize("case", sorted(BENT_IMPORTS))
def test_a_bent_import_breaks_its_contract(case: str, tmp_path: Path) -> None:
    """The control: the same check over a copy with one import bent (inside a function: lazy imports count)."""
    module, statement, contract = BENT_IMPORTS[case]
    shutil.copytree(ROOT / "kvfsm", tmp_path / "kvfsm", ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / module).open("a") as source:
        source.write(f"\n\ndef _bent() -> None:\n    {statement}  # noqa\n")
    run = lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(re.escape(contract) + r"[^\n]*BROKEN", run.stdout), run.stdout


def test_every_product_module_is_barred_from_the_test_package() -> None:
    """A package added to kvfsm is product code until listed otherwise: the contract must name it, or it could
    import test code unchecked."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    barred = [set(c["source_modules"]) for c in contracts if c.get("forbidden_modules") == ["kvfsm.testing"]]
    modules = {f"kvfsm.{path.stem}" for path in (ROOT / "kvfsm").iterdir()
               if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()}
    assert barred == [modules - {"kvfsm.testing"}]
