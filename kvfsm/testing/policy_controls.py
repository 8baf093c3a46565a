"""Deliberately unsafe eviction policies: the conformance suite's controls, each breaking one rule of the contract
(`kvfsm.manager.policies.base`). `python -m kvfsm.testing.conformance --controls` shows every one caught; a user can
name them by import path (`kvfsm.testing.policy_controls:IgnoresPins`) to see what a failing report looks like.
"""

from __future__ import annotations

from kvfsm.manager.policies import Evictable, LruPolicy


class IgnoresPins(LruPolicy):
    """Breaks `victims-offered`: answers the least recent slots without asking whether they may go, so a pinned,
    loading or written-back block (or one of the store being planned) can be chosen."""

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        return super().victims(n, lambda _slot: True)


class TakesOneMore(LruPolicy):
    """Breaks `victims-exact`: answers one slot more than asked whenever it can."""

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        return super().victims(n + 1, evictable) or super().victims(n, evictable)


class NamesAFreeSlot(LruPolicy):
    """Breaks `victims-held`: answers the lowest slot it does not hold (a free one) in place of its first victim."""

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        chosen = super().victims(n, evictable)
        free = next((slot for slot in range(self.capacity) if slot not in self.order), None)
        return chosen if chosen is None or free is None else [free, *chosen[1:]]


class EvictsWhileAsked(LruPolicy):
    """Breaks `victims-a-question`: forgets the slots it answers, as if asking were evicting."""

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        chosen = super().victims(n, evictable)
        for slot in chosen or ():
            self.order.move_to_end(slot)
        return chosen


class GivesUpEarly(LruPolicy):
    """Breaks `victims-none-only-when-short`: never offers more than one victim, so a store of two never fits."""

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        return super().victims(n, evictable) if n == 1 else None


class KeepsAfterReset(LruPolicy):
    """Breaks `holds-readable`: ignores `clear`, so it goes on holding slots a cache reset freed."""

    def clear(self) -> None:
        pass


CONTROLS: dict[str, type[LruPolicy]] = {
    "victims-offered": IgnoresPins,
    "victims-exact": TakesOneMore,
    "victims-held": NamesAFreeSlot,
    "victims-a-question": EvictsWhileAsked,
    "victims-none-only-when-short": GivesUpEarly,
    "holds-readable": KeepsAfterReset,
}
"""The rule each control breaks."""
