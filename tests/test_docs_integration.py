"""docs/integration.md's runnable example is code, not prose: this test runs the block exactly as the page shows it,
so the page cannot drift from the API (a renamed call, a missing `run_until_idle`) without failing here."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

PAGE = Path(__file__).parent.parent / "docs" / "integration.md"
MARKER = "<!-- tested: tests/test_docs_integration.py runs the next block as written -->"


def example_block(page: str) -> str:
    """The fenced python block right after the marker; exactly one marker on the page."""
    assert page.count(MARKER) == 1, f"docs/integration.md must hold exactly one {MARKER!r}"
    found = re.match(r"\s*```python\n(.*?)^```", page.split(MARKER)[1], flags=re.DOTALL | re.MULTILINE)
    assert found, "the marker must be followed by a ```python block"
    return found.group(1)


def run_as_module(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `code` as a module of its own, as a reader's script would be (its dataclasses look their module up)."""
    module = types.ModuleType("integration_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, f"{PAGE}:example", "exec"), module.__dict__)


def test_the_simdevice_example_of_the_integration_page_runs_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    run_as_module(example_block(PAGE.read_text()), monkeypatch)


def test_control_the_example_without_driving_the_simulator_never_completes_its_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The page says a SimDevice left undriven never progresses; the same block without that line fails."""
    code = example_block(PAGE.read_text())
    undriven = re.sub(r"^(\s*)device\.run_until_idle\(\).*$", r"\1pass", code, flags=re.MULTILINE)
    assert undriven != code
    with pytest.raises(AssertionError):
        run_as_module(undriven, monkeypatch)
