"""A Mooncake tier's lookups, writes and the values it shuns, submitted to the tier itself on a real master: a
lookup of keys all published here counts them, a key being written here is not asked of the store, a lookup adopts
the keys the store holds up to the first it lacks and none past one being written here, and a lookup the store
leaves unanswered or refuses is a miss with a warning; a write of keys held already ends at once (a job id in
flight is refused: test_mooncake_tier_reads.py); a value that fails its check is counted, removed from the store and not adopted again (at most
`index_keys` such keys remembered, the oldest forgotten first) until this tier writes the key itself."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

pytest.importorskip("mooncake.store")

from kvfsm.executor.pool import HostPool  # noqa: E402
from kvfsm.mooncake.value import TRAILER_BYTES, trailer_key  # noqa: E402
from kvfsm.tiers.base import TierCompletion, TierFailure  # noqa: E402
from kvfsm.tiers.mooncake import MooncakeTier  # noqa: E402
from test_mooncake_heads import completion  # noqa: E402
from test_mooncake_tier_reads import ABSENT, JOB_IDS, STORED, open_tier, tier, view  # noqa: E402,F401 (tier: a fixture)

FORGED = 0xEE
FIRST, SECOND, THIRD = 0x61, 0x62, 0x63
STORE_BUDGET_S = 10.0


def read(tier_: MooncakeTier, pool: HostPool, key: int) -> TierCompletion:
    job = next(JOB_IDS)
    tier_.submit_read(job, [key], [view(pool, 1)])
    return completion(tier_, job)


def write(tier_: MooncakeTier, pool: HostPool, key: int) -> TierCompletion:
    job = next(JOB_IDS)
    tier_.submit_write(job, [key], [view(pool, 0)])
    return completion(tier_, job)


def forge(tier_: MooncakeTier, key: int) -> None:
    """Another client of the master puts a value of the right length under `key` that no MAC of the tenant seals."""
    store, name = tier_.client.raw(), tier_.store_key(key)
    assert store.put(name, bytes([FORGED]) * tier_.block_bytes) == 0
    assert store.put(trailer_key(name), bytes([FORGED]) * TRAILER_BYTES) == 0


def reject(tier_: MooncakeTier, pool: HostPool, key: int) -> None:
    """Forge `key`, let the tier adopt it, and read it: its check fails."""
    forge(tier_, key)
    assert tier_.lookup([key]) == 1
    assert read(tier_, pool, key).failed == {key: TierFailure.corrupt}


def removed(tier_: MooncakeTier, key: int) -> bool:
    """Whether the store drops `key` within `STORE_BUDGET_S` (the tier's removal is asynchronous)."""
    return settles(tier_, key, held=False)


def stored(tier_: MooncakeTier, key: int) -> bool:
    """Whether the store holds `key` within `STORE_BUDGET_S`, asked without polling the tier."""
    return settles(tier_, key, held=True)


def settles(tier_: MooncakeTier, key: int, held: bool) -> bool:
    deadline = time.monotonic() + STORE_BUDGET_S
    while (tier_.client.raw().batch_is_exist([tier_.store_key(key)])[0] == 1) != held:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_lookup_of_keys_all_published_here_counts_them_all(tier) -> None:
    tier_, _ = tier
    assert tier_.lookup([STORED]) == 1


def test_a_lookup_does_not_ask_the_store_for_a_key_being_written_here(tier, monkeypatch) -> None:
    tier_, pool = tier
    asked: list[list[str]] = []
    ask = tier_.client.contains
    monkeypatch.setattr(tier_.client, "contains", lambda keys: asked.append(list(keys)) or ask(keys))
    job = next(JOB_IDS)
    tier_.submit_write(job, [FIRST], [view(pool, 1)])  # the key is being written until a poll publishes it
    assert tier_.lookup([FIRST]) == 0 and asked == []
    assert completion(tier_, job).ok


def test_a_lookup_the_store_leaves_unanswered_or_refuses_is_a_miss_and_warns_naming_the_tier_and_why(
        fresh_mooncake, caplog) -> None:
    """The first lookup waits out its `lookup_timeout_s` on a paused master; the second finds its one pending call
    still queued there, and the client refuses it (`StoreBusy`)."""
    tier_, _ = open_tier(fresh_mooncake, lookup_timeout_s=0.05, max_pending=1)
    try:
        fresh_mooncake.pause_master()
        try:
            with caplog.at_level(logging.WARNING, logger="kvfsm.tiers.mooncake"):
                assert tier_.lookup([FIRST]) == 0 and tier_.lookup([FIRST]) == 0
        finally:
            fresh_mooncake.resume_master()
        assert caplog.messages == [
            f"mooncake tier {tier_.name}: lookup got no answer within 0.05s; counted as a miss",
            f"mooncake tier {tier_.name}: lookup: StoreBusy: 1 calls already pending"]
    finally:
        tier_.close()


def held_elsewhere(tier_: MooncakeTier, pool: HostPool, keys: list[int]) -> None:
    """Put `keys` (at most two) in the store and forget them here: keys other engines wrote, as a lookup meets them."""
    job = next(JOB_IDS)
    tier_.submit_write(job, keys, [view(pool, slot) for slot in range(1, len(keys) + 1)])
    assert completion(tier_, job).ok
    tier_.discard(keys)


def test_a_lookup_adopts_the_keys_the_store_holds_up_to_the_first_it_lacks(tier) -> None:
    tier_, pool = tier
    held_elsewhere(tier_, pool, [FIRST, SECOND])
    assert tier_.lookup([FIRST, SECOND, ABSENT]) == 2


def test_a_lookup_the_store_answers_for_its_first_key_but_not_its_second_adopts_the_first(tier, monkeypatch) -> None:
    """The fault stops the walk at the key it names: the keys shown before it are adopted all the same."""
    tier_, pool = tier
    held_elsewhere(tier_, pool, [FIRST, SECOND])
    store, unanswered = tier_.client._store, {tier_.store_key(SECOND), trailer_key(tier_.store_key(SECOND))}
    monkeypatch.setattr(tier_.client, "_store", type("Answers", (), {"batch_is_exist": staticmethod(
        lambda names: [-900 if name in unanswered else code for name, code in zip(names, store.batch_is_exist(names))])
    })())
    assert tier_.lookup([FIRST, SECOND]) == 1


def test_a_lookup_adopts_no_key_past_one_being_written_here(tier) -> None:
    """Even when the store shows the key being written already (its put ended; this tier has not polled it)."""
    tier_, pool = tier
    held_elsewhere(tier_, pool, [FIRST, THIRD])
    job = next(JOB_IDS)
    tier_.submit_write(job, [SECOND], [view(pool, 0)])
    assert stored(tier_, SECOND), "the write never reached the store"
    assert tier_.lookup([FIRST, SECOND, THIRD]) == 1
    assert tier_.entries.get(THIRD) is None, "a key past the one being written was adopted"
    assert completion(tier_, job).ok


def test_a_write_of_keys_the_tier_holds_already_ends_ok_at_once(tier) -> None:
    tier_, pool = tier
    job = next(JOB_IDS)
    tier_.submit_write(job, [STORED], [view(pool, 0)])
    done = completion(tier_, job)
    assert done.ok and not done.held, "a job with nothing to move was reported past its deadline"


def test_a_value_that_fails_its_check_is_counted_removed_from_the_store_and_not_adopted_again(tier) -> None:
    tier_, pool = tier
    for key in (FIRST, SECOND):
        reject(tier_, pool, key)
    assert tier_.rejected_values == 2
    assert removed(tier_, FIRST) and removed(tier_, SECOND), "a value that failed its check stayed in the store"
    for key in (FIRST, SECOND):
        forge(tier_, key)  # another engine puts the bad value back after its removal
        assert tier_.lookup([key]) == 0


def test_at_most_index_keys_shunned_keys_are_remembered_the_oldest_forgotten_first(mooncake) -> None:
    tier_, pool = open_tier(mooncake, index_keys=1)
    try:
        for key in (FIRST, SECOND):
            reject(tier_, pool, key)
            assert removed(tier_, key)
            forge(tier_, key)
        assert tier_.lookup([SECOND]) == 0, "the newest shunned key was forgotten"
        assert tier_.lookup([FIRST]) == 1, "a key beyond the bound was still shunned"
    finally:
        tier_.close()


def test_a_key_this_tier_writes_itself_after_its_value_failed_its_check_is_adopted_again(tier) -> None:
    tier_, pool = tier
    reject(tier_, pool, FIRST)
    assert removed(tier_, FIRST)
    assert write(tier_, pool, FIRST).ok
    tier_.discard([FIRST])
    assert tier_.lookup([FIRST]) == 1


@contextmanager
def puts_answered(tier_: MooncakeTier, monkeypatch: pytest.MonkeyPatch, code: int) -> Iterator[None]:
    """Inside the block, the store answers `code` to every put of the tier's client (and is itself again after)."""
    store = tier_.client._store
    monkeypatch.setattr(tier_.client, "_store", type("Refusing", (), {
        "__getattr__": lambda self, name: getattr(store, name),
        "batch_put_from": staticmethod(lambda names, *args: [code] * len(names))})())
    yield
    monkeypatch.setattr(tier_.client, "_store", store)


def test_a_key_whose_value_failed_its_check_stays_shunned_when_this_tiers_own_write_of_it_fails(tier,
                                                                                                  monkeypatch) -> None:
    """Only a write that succeeded makes the key this tier's again: after a failed one, a bad value another engine
    puts back is still never adopted."""
    tier_, pool = tier
    reject(tier_, pool, FIRST)
    assert removed(tier_, FIRST)
    with puts_answered(tier_, monkeypatch, -200):  # NO_AVAILABLE_HANDLE
        assert write(tier_, pool, FIRST).failed == {FIRST: TierFailure.full}
    forge(tier_, FIRST)
    assert tier_.lookup([FIRST]) == 0


def test_a_write_whose_transfer_fails_is_an_io_error_counting_no_rejected_value_nor_shunning_the_key(tier,
                                                                                                   monkeypatch) -> None:
    """Nothing was read, so nothing is corrupt: the forged-value counter and the shunned keys are for values that
    failed their check, and a key the store later holds (written by another engine of the tenant) is adopted."""
    tier_, pool = tier
    with puts_answered(tier_, monkeypatch, -800):  # TRANSFER_FAIL
        assert write(tier_, pool, FIRST).failed == {FIRST: TierFailure.io_error}
    assert tier_.rejected_values == 0
    held_elsewhere(tier_, pool, [FIRST])
    assert tier_.lookup([FIRST]) == 1
