"""The frequency-aware built-in eviction policies rule by rule: S3-FIFO's small and main queues, adaptive S3-FIFO's
target, W-TinyLFU's window, duel and segments, and its frequency sketch. Selection, ARC, LRU and the bounds every
policy keeps are in `test_manager_policies.py`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfsm.manager import AdaptiveS3FifoPolicy, S3FifoPolicy, TinyLfuPolicy
from kvfsm.manager.policies.sketch import MAX_COUNTER, FrequencySketch
from test_manager_policies import evict


class NoDuel(TinyLfuPolicy):
    """Control: a W-TinyLFU that admits every window candidate, however rarely it was seen."""

    def _admit(self, slot: int, block_hash: int) -> None:
        self.probation[slot] = block_hash


# S3-FIFO -----------------------------------------------------------------------------------------------------


def test_s3fifo_a_new_block_enters_small_and_one_stored_again_while_a_ghost_enters_main() -> None:
    s3 = S3FifoPolicy(10)
    s3.insert(0, 100)
    assert list(s3.small) == [0] and not s3.main
    evict(s3, 1)
    assert list(s3.ghosts) == [100]
    s3.insert(1, 100)
    assert list(s3.main) == [1] and not s3.small and not s3.ghosts


def test_s3fifo_a_hit_in_small_moves_the_block_to_main() -> None:
    s3 = S3FifoPolicy(10)
    s3.insert(0, 100)
    s3.touch(0)
    assert list(s3.main) == [0] and s3.count[0] == 0 and not s3.small


def test_s3fifo_evicts_from_small_while_it_is_over_its_share_then_where_the_hand_stops() -> None:
    s3 = S3FifoPolicy(10)  # small's share: 1 slot
    for slot in range(4):
        s3.insert(slot, 100 + slot)
    s3.touch(2)
    s3.touch(3)
    s3.touch(3)  # main = [2 (count 0), 3 (count 1)], small = [0, 1]
    assert s3.victims(4, lambda _s: True) == [0, 2, 3, 1]


def test_s3fifo_the_hand_spends_one_hit_of_each_block_it_passes() -> None:
    s3 = S3FifoPolicy(10)
    for slot in range(3):
        s3.insert(slot, 100 + slot)
        s3.touch(slot)
    s3.touch(0)  # counts 1, 0, 0
    assert s3.victims(1, lambda _s: True) == [1]
    s3.remove(1)
    assert list(s3.main) == [2, 0] and s3.count == {0: 0, 2: 0}, "the hand passed 0 without spending its hit"


# Adaptive S3-FIFO -------------------------------------------------------------------------------------------


def replay(policy: S3FifoPolicy, trace: list[tuple[str, int]]) -> None:
    """Drive `policy` as the manager would over ("store" | "hit", hash) steps: a store of a hash not held takes a
    free slot or evicts the policy's first victim; a hit touches a held hash."""
    slot_of: dict[int, int] = {}
    for op, block_hash in trace:
        if op == "hit":
            if block_hash in slot_of:
                policy.touch(slot_of[block_hash])
            continue
        if block_hash in slot_of:
            continue
        if len(slot_of) < policy.capacity:
            slot = len(slot_of)
        else:
            (slot,) = policy.victims(1, lambda _s: True) or ()
            policy.remove(slot)
            del slot_of[next(h for h, s in slot_of.items() if s == slot)]
        policy.insert(slot, block_hash)
        slot_of[block_hash] = slot


RECENCY = [("store", h) for _ in range(5) for h in range(12)]
"""12 blocks stored in turn into 10 slots, never hit: each comes back after 11 others, past a small queue of 1."""
FREQUENCY = [step for i in range(40) for step in (("store", 1000 + i), ("store", i % 4), ("hit", i % 4))]
"""4 hot blocks stored and hit over and over among one-off blocks: they belong in main."""


@pytest.mark.parametrize(("policy", "grows"), [(AdaptiveS3FifoPolicy, True), (S3FifoPolicy, False)])
def test_s3fifo_adaptive_the_small_queue_grows_on_a_recency_trace(policy: type[S3FifoPolicy], grows: bool) -> None:
    """Control: plain S3-FIFO's small queue is frozen at its share."""
    s3 = policy(10)
    replay(s3, RECENCY)
    assert (s3.small_target > 1) is grows


@pytest.mark.parametrize(("policy", "shrinks"), [(AdaptiveS3FifoPolicy, True), (S3FifoPolicy, False)])
def test_s3fifo_adaptive_the_small_queue_shrinks_on_a_frequency_trace(policy: type[S3FifoPolicy],
                                                                      shrinks: bool) -> None:
    """From a small queue of 8 of 10 slots, main is too short for the hot blocks: they come back as main's ghosts.
    Control: plain S3-FIFO's small queue stays at 8."""
    s3 = policy(10)
    s3.small_target = 8
    replay(s3, FREQUENCY)
    assert (s3.small_target < 8) is shrinks


def test_s3fifo_adaptive_clear_forgets_both_ghost_queues_and_the_target() -> None:
    s3 = AdaptiveS3FifoPolicy(10)
    replay(s3, RECENCY)
    s3.clear()
    assert s3.small_target == 1 and not s3.ghosts and not s3.main_ghosts and not len(s3)


# W-TinyLFU ---------------------------------------------------------------------------------------------------


def test_tinylfu_the_window_overflows_into_probation_while_main_has_room() -> None:
    lfu = TinyLfuPolicy(10)  # window 1, main 9
    lfu.insert(0, 100)
    lfu.insert(1, 101)
    assert list(lfu.window) == [1] and list(lfu.probation) == [0]


def fill_main(lfu: TinyLfuPolicy) -> None:
    for slot in range(lfu.main_target + lfu.window_target):
        lfu.insert(slot, 100 + slot)


def check_duel(lfu: TinyLfuPolicy) -> None:
    fill_main(lfu)  # window = [9], probation = [0..8]; all seen once
    lfu.insert(10, 110)  # candidate 9 (seen once) against 0 (seen once): a tie goes against the candidate
    assert list(lfu.doomed) == [9] and 0 in lfu.probation
    lfu.sketch.add_many([110] * 3)
    lfu.insert(11, 111)  # candidate 10 (seen 4 times) against 0 (once): 0 is doomed
    assert list(lfu.doomed) == [9, 0] and 10 in lfu.probation, "the frequency duel was not fought"


def test_tinylfu_a_candidate_enters_a_full_main_only_if_seen_more_often_than_its_rival() -> None:
    check_duel(TinyLfuPolicy(10))
    with pytest.raises(AssertionError):
        check_duel(NoDuel(10))


def test_tinylfu_doomed_blocks_go_first_then_probation_protected_and_window() -> None:
    lfu = TinyLfuPolicy(10)
    fill_main(lfu)
    lfu.insert(10, 110)  # 9 doomed
    lfu.touch(1)  # 1 protected
    assert lfu.victims(11, lambda _s: True) == [9, 0, 2, 3, 4, 5, 6, 7, 8, 1, 10]


def test_tinylfu_a_hit_in_probation_protects_and_protected_overflow_goes_back_to_probation() -> None:
    lfu = TinyLfuPolicy(10)  # protected holds 7
    fill_main(lfu)
    for slot in range(8):
        lfu.touch(slot)
    assert list(lfu.protected) == [1, 2, 3, 4, 5, 6, 7] and list(lfu.probation) == [8, 0]


def test_tinylfu_a_doomed_block_hit_before_its_eviction_is_protected() -> None:
    lfu = TinyLfuPolicy(10)
    fill_main(lfu)
    lfu.insert(10, 110)
    lfu.touch(9)
    assert not lfu.doomed and 9 in lfu.protected


@given(st.lists(st.integers(-(1 << 70), 1 << 70), max_size=200))
def test_the_sketch_never_counts_a_hash_less_often_than_it_was_added_below_saturation(keys: list[int]) -> None:
    sketch = FrequencySketch(1 << 12)  # sample 40k: no halving within 200 additions
    sketch.add_many(keys)
    for key in set(keys):
        assert sketch.estimate(key) >= min(keys.count(key), MAX_COUNTER)


def test_the_sketch_halves_every_counter_after_ten_additions_per_slot() -> None:
    sketch = FrequencySketch(4)
    sketch.add_many([7] * 39)
    assert sketch.estimate(7) == MAX_COUNTER
    sketch.add_many([7])
    assert sketch.estimate(7) == MAX_COUNTER // 2 and sketch.additions == 20
