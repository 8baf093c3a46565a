"""`BoundedCall` (kvfsm/tiers/bounded.py): a lower tier's lookup waits for a slow store at most its bound, and the
call that overran it stays visible to an operator without holding anything up."""

from __future__ import annotations

import logging
import threading

import pytest

from kvfsm.tiers.bounded import BoundedCall

NAME = "disk tier 'disk' lookup"


def test_a_call_past_its_bound_is_a_miss_logged_with_its_name_and_bound(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    call = BoundedCall(NAME, timeout_s=0.05)
    with caplog.at_level(logging.WARNING, logger="kvfsm.tiers.bounded"):
        assert call(release.wait) is None
    release.set()
    call.close()
    assert [r.getMessage() for r in caplog.records] == [f"{NAME} got no answer within 0.05s; counted as a miss"]


def test_the_calls_run_on_a_thread_named_after_them() -> None:
    """A hung store shows in a thread dump under the tier and the call it hung."""
    call = BoundedCall(NAME, timeout_s=5.0)
    assert call(lambda: threading.current_thread().name) == f"kvfsm-{NAME}"
    call.close()


def test_closing_does_not_wait_for_a_hung_call() -> None:
    """Closing runs on the scheduler's thread at shutdown: a store hung for good must not hang the engine's exit."""
    release = threading.Event()
    call = BoundedCall(NAME, timeout_s=0.01)
    assert call(release.wait) is None
    closing = threading.Thread(target=call.close, daemon=True)
    closing.start()
    closing.join(timeout=2.0)
    still_closing = closing.is_alive()
    release.set()
    assert not still_closing, "close waited for the hung call"
