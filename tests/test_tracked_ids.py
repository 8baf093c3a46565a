"""The ids each KV-cache group of a request is tracked under (`kvfsm.connector.tracked_ids`): recorded as they are
made and read back from the record, never parsed, since a request id may hold the separator itself."""

from __future__ import annotations

import pytest

from kvfsm.connector.tracked_ids import TrackedIdClash, TrackedIds


def test_a_tracked_id_is_read_back_as_the_request_and_group_it_was_made_for() -> None:
    ids = TrackedIds()
    assert ids.make_all("chat@gpt-1", (None, 1)) == ["chat@gpt-1", "chat@gpt-1@g1"]
    assert ids.owner("chat@gpt-1@g1") == ("chat@gpt-1", 1)
    assert ids.owner("chat@gpt-1") == ("chat@gpt-1", None)


def test_an_id_another_live_requests_group_holds_is_refused_by_name_and_not_recorded() -> None:
    ids = TrackedIds()
    ids.make_all("chat", (None, 1))
    with pytest.raises(TrackedIdClash, match="'chat@g1'.*'chat'"):
        ids.make("chat@g1", None)
    assert ids.owner("chat@g1") == ("chat", 1) and len(ids) == 2


def test_a_forgotten_requests_ids_are_free_for_another_request() -> None:
    ids = TrackedIds()
    ids.make_all("chat", (None, 1))
    ids.forget("chat")
    assert len(ids) == 0
    assert ids.make("chat@g1", None) == "chat@g1" and ids.owner("chat@g1") == ("chat@g1", None)


def test_forgetting_a_request_that_made_no_ids_changes_nothing() -> None:
    ids = TrackedIds()
    ids.make_all("chat", (None, 1))
    ids.forget("never-seen")
    assert len(ids) == 2 and ids.owner("chat@g1") == ("chat", 1)


def test_a_request_whose_later_group_clashes_records_none_of_its_ids() -> None:
    ids = TrackedIds()
    ids.make_all("chat@g1", (None,))
    with pytest.raises(TrackedIdClash):
        ids.make_all("chat", (None, 1))
    assert len(ids) == 1 and ids.owner("chat@g1") == ("chat@g1", None)
