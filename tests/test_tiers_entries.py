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
