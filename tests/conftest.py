"""Hypothesis profiles and the `gpu` marker.

`ci` is registered under the name hypothesis would otherwise fill with its built-in profile when CI=true, so the
project's bounds win. Every profile prints the reproduction blob of a failing example.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

_common = dict(print_blob=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

settings.register_profile("ci", max_examples=60, derandomize=True, **_common)
settings.register_profile("dev", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
settings.register_profile("gpu", max_examples=30, **_common)
settings.register_profile("mutmut", max_examples=8, derandomize=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The simulator's tensors are tiny: intra-op threads only contend, and on a busy 2-core CI machine they made
# SimDevice runs up to 30x slower.
torch.set_num_threads(1)


SLOW_LAST = ("test_exploration.py", "test_interleavings.py")
"""Under mutmut (which stops at the first failure), the whole-system searches run after the focused tests, so a
mutant a focused test kills costs seconds."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "MUTANT_UNDER_TEST" in os.environ:
        items.sort(key=lambda item: item.path.name in SLOW_LAST)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
