"""`OffloadConfig.kv_events` is the one switch for `Connector.take_events()`: on, every CPU block that becomes
loadable is announced stored and every one evicted is announced removed; off, nothing is recorded (an engine
that never drains the list would hold it forever)."""

from __future__ import annotations

from kvfsm.connector import Connector
from kvfsm.connector.metadata import ConnectorOutput, SchedulerOutput
from kvfsm.manager import BlockRemoved, BlockStored
from test_boundaries import BLOCK, Req, done, registered, scheduled


def store(connector: Connector, req_id: str, hashes: tuple[int, ...], blocks: tuple[int, ...]) -> None:
    """Compute `req_id`'s prompt into `blocks` and complete the stores of its full blocks."""
    request = Req(req_id, hashes, len(hashes) * BLOCK + 1)
    connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, blocks, 0)
    step = SchedulerOutput(scheduled=(scheduled(req_id, blocks, request.num_tokens),))
    stores = connector.build_connector_meta(step).stores
    connector.build_connector_meta(SchedulerOutput())  # the stores are submitted with the next step
    connector.update_connector_output(ConnectorOutput(workers=(done(*(s.job_id for s in stores)),)))
    connector.request_finished(req_id)


def store_then_evict(connector: Connector) -> None:
    """Fill the pool (8 CPU blocks) with one prompt, then store another that evicts two of its blocks."""
    store(connector, "first", tuple(range(1, 9)), tuple(range(9)))
    store(connector, "second", (21, 22), (9, 10, 11))


def test_with_kv_events_on_a_store_and_an_eviction_are_announced() -> None:
    connector = registered(kv_events=True)
    store_then_evict(connector)
    first, *rest = connector.take_events()
    assert first == BlockStored(tuple(range(1, 9)))
    removed = {h for e in rest if isinstance(e, BlockRemoved) for h in e.hashes}
    stored = {h for e in rest if isinstance(e, BlockStored) for h in e.hashes}
    assert len(removed) == 2 and removed <= set(range(1, 9)) and stored == {21, 22}
    assert connector.take_events() == [], "events are handed out once"


def test_with_kv_events_off_nothing_is_recorded() -> None:
    connector = registered()
    store_then_evict(connector)
    assert connector.take_events() == []
    assert {21, 22} <= set(connector.scheduler.manager.catalogue), "the stores did happen"
