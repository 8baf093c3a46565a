"""Admission: which of a request's newly completed CPU blocks are offered to the pool, and which are skipped.

Every block stored costs PCIe bandwidth that loads and the next step's stores compete for, and host memory that
evicts blocks someone may hit. Two rules skip the blocks least likely to pay that back: `prompt-only` skips decode
blocks (a request's own generated tokens, which no other request shares), and `store_threshold` skips a block
until enough requests offered it to suggest it will be hit again; with `store_threshold_scope` `cold-prefix` the
threshold counts only a block that starts a prefix the pool does not hold, since a block's hash covers its whole
prefix: one after a stored prefix continues something already paid for (a chat's next turn), one after nothing
stored is a new document that may never come back. A skip is decided once per request and block
and is final for that request: the scheduler fires the request's `skip-store` transition with the skipped blocks
(spec/request.yaml), and no store of that request ever carries them (`skipped-not-stored`).

This module decides; it moves no lifecycle itself.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Container, Sequence

from kvfsm.config import OffloadConfig
from kvfsm.records import RequestRecord

PROMPT_ONLY, THRESHOLD = "prompt-only", "threshold"
REASONS = (PROMPT_ONLY, THRESHOLD)
"""Why a block was skipped: past its request's prompt, or offered fewer times than `store_threshold`."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What an offer decided: the hashes to hand to the pool, in order, and those skipped now, by reason."""

    admitted: Sequence[int]
    skipped: dict[str, tuple[int, ...]] = field(default_factory=dict)
    readmitted: int = 0
    """How many of `admitted`, from the first, an earlier offer of this request admitted (it was preempted and
    recomputes): a store of one may still be in flight, so back-pressure must not shed it now."""


class Admission:
    """The admission rules of one scheduler half, with the offer counts `store_threshold` needs (bounded)."""

    def __init__(self, config: OffloadConfig) -> None:
        self.prompt_only = config.admission == PROMPT_ONLY
        self.threshold = config.store_threshold
        self.cold_prefix_only = config.store_threshold_scope == "cold-prefix"
        self.tracked = config.store_offers_tracked
        self.offers: OrderedDict[int, int] = OrderedDict()
        """Per block hash, how many requests offered it; the least recently offered is forgotten past `tracked`."""
        self.admits_all = not self.prompt_only and self.threshold == 1
        """No rule can skip: an offer is every candidate, with no work per block."""

    def offer(self, record: RequestRecord, start: int, hashes: Sequence[int], held: Container[int],
              parent: int | None = None) -> Verdict:
        """The request offers its CPU blocks `start, start + 1, ...` (`hashes`); `held`: the hashes the pool holds;
        `parent`: the hash of block `start - 1` (None at the first block), for `cold-prefix`.

        A block this request offered before (it was preempted and recomputes) is not counted again: one that was
        admitted stays admitted, one that was skipped stays skipped."""
        first_new = max(record.offered_cpu_blocks - start, 0)
        record.offered_cpu_blocks = max(record.offered_cpu_blocks, start + len(hashes))
        skipped = record.skipped
        if self.admits_all and not skipped:  # only back-pressure skipped any: none of them to leave out
            return Verdict(hashes, readmitted=min(first_new, len(hashes)))
        prompt_end = record.prompt_cpu_blocks - start if self.prompt_only else len(hashes)
        admitted: list[int] = []
        past_prompt: list[int] = []
        too_few: list[int] = []
        readmitted = 0
        warm = self.cold_prefix_only and parent is not None and (parent in held or parent not in skipped)
        counting = self.threshold > 1
        threshold, cold_prefix_only, offers, tracked = self.threshold, self.cold_prefix_only, self.offers, self.tracked
        for index, block_hash in enumerate(hashes):
            if block_hash in skipped:
                warm = False
            elif index < first_new:
                admitted.append(block_hash)
                readmitted += 1
                warm = cold_prefix_only
            elif index >= prompt_end:
                past_prompt.append(block_hash)
                warm = False
            elif counting and not warm:
                count = offers.pop(block_hash, 0) + 1  # one more offer of the block (the hot path: inlined)
                offers[block_hash] = count
                if len(offers) > tracked:  # the least recently offered is forgotten
                    offers.popitem(last=False)
                if count < threshold and block_hash not in held:
                    too_few.append(block_hash)
                else:
                    admitted.append(block_hash)
                    warm = cold_prefix_only
            else:
                admitted.append(block_hash)
                warm = cold_prefix_only
        reasons = ((PROMPT_ONLY, past_prompt), (THRESHOLD, too_few))
        return Verdict(admitted, {reason: tuple(found) for reason, found in reasons if found}, readmitted)
