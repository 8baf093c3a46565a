"""A disk tier's submits, key by key: a key held already is skipped and the rest still written, a key without room
fails `full` and so do the ones after it, a carried checksum is what the file is stored with, a job id in flight is
refused, a block found at open is not served before a lookup adopts it, and a full tier makes room for a block another
engine wrote by evicting its least recent key; a dormant block written again counts once, and a lookup of a key being written here evicts nothing."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

from kvfsm.tiers.base import TierFailure, TierMisuse
from test_tiers_disk import BLOCK, _block, _tier
from test_tiers_disk_shared import _tier as _shared_tier
from test_tiers_disk_shared import _settle, _write


def _written(tier, job: int, keys: list[int], **options: object):  # type: ignore[no-untyped-def]
    tier.submit_write(job, keys, [_block(k) for k in keys], **options)
    tier._io.run_all()
    (done,) = tier.poll()
    return done


def test_a_write_skips_a_key_held_already_and_writes_the_ones_after_it(tmp_path: Path) -> None:
    tier = _tier(tmp_path, slots=4)
    assert _written(tier, 1, [1]).ok
    assert _written(tier, 2, [1, 2]).ok and tier.lookup([1, 2]) == 2
    tier.close()


def test_every_key_of_a_write_without_room_fails_full(tmp_path: Path) -> None:
    tier = _tier(tmp_path, slots=1)
    assert dict(_written(tier, 1, [1, 2, 3]).failed) == {2: TierFailure.full, 3: TierFailure.full}
    tier.close()


def test_a_block_is_stored_with_the_checksum_the_engine_carried(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    carried = zlib.crc32(_block(5)) ^ 1  # the CPU copy changed since it was first stored
    assert _written(tier, 1, [5], checksums=[carried]).ok
    tier.submit_read(2, [5], [memoryview(np.zeros(BLOCK, dtype=np.uint8))])
    tier._io.run_all()
    (done,) = tier.poll()
    assert dict(done.failed) == {5: TierFailure.corrupt}
    tier.close()


def test_a_job_id_in_flight_is_refused_for_a_write_and_a_read(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.submit_write(1, [5], [_block(5)])
    with pytest.raises(TierMisuse, match="^disk tier 'disk': job 1 is already in flight$"):
        tier.submit_write(1, [6], [_block(6)])
    with pytest.raises(TierMisuse, match="already in flight"):
        tier.submit_read(1, [6], [memoryview(np.zeros(BLOCK, dtype=np.uint8))])
    tier.close()


def test_a_block_found_at_open_has_no_stored_bytes_until_a_lookup_adopts_it(tmp_path: Path) -> None:
    first = _shared_tier(tmp_path)
    _write(first, [9])
    first.close()
    again = _shared_tier(tmp_path)
    assert again.stored_bytes(9) is None
    assert again.lookup([9]) == 1 and again.stored_bytes(9) is not None
    again.close()


def test_a_full_tier_adopts_a_block_another_engine_wrote_by_evicting_its_least_recent(tmp_path: Path) -> None:
    full, other = _shared_tier(tmp_path, slots=1), _shared_tier(tmp_path)
    _write(full, [1])
    _write(other, [2])
    assert full.lookup([2]) == 1 and full.lookup([1]) == 0
    full.close()
    other.close()


def test_a_block_found_at_open_and_written_again_is_no_longer_the_first_to_go(tmp_path: Path) -> None:
    first = _shared_tier(tmp_path, slots=2)
    _write(first, [1])
    first.close()
    again = _shared_tier(tmp_path, slots=2)
    _write(again, [1])
    _write(again, [2], job=2)
    assert again.lookup([1, 2]) == 2 and again.stored_bytes(1) is not None
    again.close()


def test_a_lookup_of_a_key_this_tier_is_writing_evicts_nothing_though_another_engine_wrote_it(tmp_path: Path) -> None:
    writing, other = _shared_tier(tmp_path, slots=2), _shared_tier(tmp_path)
    _write(writing, [5])
    writing.submit_write(2, [4], [memoryview(np.zeros(writing.block_bytes, dtype=np.uint8))])
    _write(other, [4])
    assert writing.lookup([4]) == 0 and writing.lookup([5]) == 1
    _settle(writing)
    writing.close()
    other.close()
