"""An allocation whose lookup's match was evicted since is refused by name before any state changes.

The lookup offers the CPU blocks it found ready but does not pin them (an engine may never allocate); a call between
the lookup and the allocation (a step whose stores made room, another request's fetch) may evict them. vLLM
allocates right after the lookup, so only a caller that allocates against an old lookup meets this; the refusal
tells it to look the request up again, which the request, still `matched`, may do, and which then answers a miss the
engine computes. Before the fix the request moved to `loading` and only then met the evicted blocks: stuck there with
no job. The scheduler half alone, driven as in test_connector_scheduler.py.
"""

from __future__ import annotations

import pytest

from kvfsm.connector.refusals import StaleMatch
from kvfsm.states import RequestState
from kvfsm.testing.snapshot import snapshot
from test_connector_scheduler import BLOCK, admit, compute, connector, prompt, store_prefix


def test_an_allocation_whose_match_was_evicted_since_its_lookup_is_refused_and_changes_nothing() -> None:
    sched = connector(cpu_blocks=2)
    store_prefix(sched, prompt("a", [1, 2]), range(3))
    late = prompt("late", [1, 2])
    assert sched.get_num_new_matched_tokens(late, 0) == (2 * BLOCK, True)
    other = prompt("other", [7, 8])
    admit(sched, other, range(6, 9))
    assert compute(sched, other, range(6, 9)).stores, "the other request's store evicts the matched prefix"
    assert 1 not in sched.manager.catalogue
    before = snapshot(sched)
    with pytest.raises(StaleMatch, match="^update_state_after_alloc: request 'late'"):
        sched.update_state_after_alloc(late, range(3, 6), 2 * BLOCK)
    assert snapshot(sched) == before, "the refused allocation changed the connector"
    assert sched.requests["late"].state == RequestState.MATCHED
    assert admit(sched, late, range(3, 6)) == (0, False), "looked up again, it is a miss the engine computes"
