"""A tier's index of its keys: the eviction candidate is the published key used longest ago, passing over keys being
read (pinned: their bytes are still being copied out) and the keys the caller keeps."""

from __future__ import annotations

from kvfsm.machines import default_machines
from kvfsm.tiers.entries import TierEntries


def test_the_least_recent_evictable_key_passes_over_keys_being_read_and_keys_kept() -> None:
    entries = TierEntries("tier", default_machines())
    for key in (1, 2):
        entries.adopt(key)
    entries.pin(2)
    entries.read_done(entries.pin(1))  # 2 is now the key used longest ago, and is still being read
    assert entries.least_recent_evictable() == 1
    entries.adopt(3)
    assert entries.least_recent_evictable(keep={1}) == 3
    assert entries.least_recent_evictable(keep={1, 3}) is None


def test_a_new_entry_writes_at_the_slot_it_was_given() -> None:
    assert TierEntries("tier", default_machines()).reserve(5, slot=3).slot == 3  # type: ignore[union-attr]


def test_lookups_are_recorded_only_when_asked() -> None:
    entries = TierEntries("tier", default_machines())
    entries.adopt(1)
    entries.lookup((1,))
    assert entries.lookups == []


def test_a_bounded_index_forgets_the_least_recent_published_key_only_past_its_bound() -> None:
    entries = TierEntries("tier", default_machines(), bound=2)
    for key in (1, 2):
        entries.adopt(key)
    assert {entry.key for entry in entries} == {1, 2}
    entries.publish(entries.reserve(3), checksum=0)  # type: ignore[arg-type]
    assert {entry.key for entry in entries} == {2, 3}


def test_a_bounded_index_keeps_a_key_being_read_and_forgets_a_published_one_in_its_place() -> None:
    entries = TierEntries("tier", default_machines(), bound=1)
    entries.adopt(1)
    entries.pin(1)
    entries.adopt(2)
    assert {entry.key for entry in entries} == {1}
