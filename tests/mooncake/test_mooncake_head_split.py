"""Cutting a rank's CPU block into one value per KV head, and folding the heads' answers into the block's: a split
that does not come out whole is refused by name, a head call is judged at its poller's clock, and a block's
write-back answer is the CRC-32 of its heads' checksums."""

from __future__ import annotations

import struct
import time
import zlib

import pytest

from kvfsm.mooncake.errors import StoreTimeout
from kvfsm.mooncake.heads import HeadCalls, HeadsDoNotSplit, HeadSplit, fold
from kvfsm.mooncake.io_thread import CancellableCall, Pending
from kvfsm.tiers.io import ManualIo


@pytest.mark.parametrize(("kv_heads", "row_bytes", "block_bytes", "message"), [
    (3, 8, 64, "3 KV heads do not divide among 2 ranks"),
    (4, 5, 60, "rows of 5 bytes do not hold 2 heads each, or do not tile a CPU block of 60 bytes"),
    (4, 8, 60, "rows of 8 bytes do not hold 2 heads each, or do not tile a CPU block of 60 bytes"),
], ids=["heads among ranks", "heads in a row", "rows in a block"])
def test_a_split_that_does_not_come_out_whole_is_refused_by_name(kv_heads: int, row_bytes: int, block_bytes: int,
                                                                  message: str) -> None:
    with pytest.raises(HeadsDoNotSplit) as refused:
        HeadSplit.of_rank(kv_heads, 1, 2, row_bytes, block_bytes)
    assert str(refused.value) == message


def test_a_head_call_is_judged_at_the_time_its_poller_gives() -> None:
    """A tier polls its jobs at its own clock: a call still queued at a `now` past its deadline times out then,
    whatever the wall clock says."""
    timed_out = [StoreTimeout("queued"), StoreTimeout("queued")]
    call = CancellableCall(lambda: [1, 2], lambda: timed_out)
    deadline = time.monotonic() + 3600.0
    calls = HeadCalls(Pending(ManualIo().submit(call), call, deadline, lambda: None, timed_out), per_entry=2)
    assert calls.poll(deadline - 1.0) is None
    assert calls.poll(deadline) == [timed_out[0]]


def test_a_blocks_write_back_answer_is_the_crc32_of_its_heads_checksums_in_head_order() -> None:
    assert fold([1, 2]) == zlib.crc32(struct.pack("<II", 1, 2)) != fold([2, 1])
