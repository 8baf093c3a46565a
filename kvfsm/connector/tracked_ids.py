"""The ids an engine's KV-cache groups of one request are tracked under, and the way back from an id to its request.

An engine with several KV-cache groups (full attention beside sliding windows or state-space layers) offloads each
group of a request as a request of its own in kvfsm's one scheduler: the first group under the request's own id,
every other under `<id>@g<group>` (`tracked_id`). kvfsm reports what ended by tracked id, and the engine must tell
which request it belongs to. The id is never parsed back: a request id is the user's string and may hold `@g` itself
("chat@gpt-1"), so splitting at the first `@g` names another request and splitting at the last misreads the first
group's id of such a request. `TrackedIds` records each id's request and group as the id is made. Shared by the vLLM
adapter (kvfsm/integrations/vllm/) and the hybrid rig (kvfsm/testing/hybrid_rig.py), so both name groups alike.
"""

from __future__ import annotations

from typing import Iterable

SEPARATOR = "@g"
"""Between a request's id and its group's number in the id of a group other than the first."""


class TrackedIdClash(ValueError):
    """Two groups of live requests would be tracked under one id (a request id equal to another's `<id>@g<group>`):
    kvfsm would take them for one request."""


def tracked_id(req_id: str, group: int | None) -> str:
    """The id kvfsm's scheduler tracks `group` of the request under: the request's own for its first group (None),
    `<id>@g<group>` for another."""
    return req_id if group is None else f"{req_id}{SEPARATOR}{group}"


class TrackedIds:
    """Each tracked id's request and group, recorded when the id is made and kept until the request is forgotten."""

    def __init__(self) -> None:
        self._owners: dict[str, tuple[str, int | None]] = {}
        self._ids: dict[str, set[str]] = {}

    def make(self, req_id: str, group: int | None) -> str:
        """The group's tracked id, recorded; refuses by name an id another live request's group holds already."""
        [tracked] = self.make_all(req_id, (group,))
        return tracked

    def make_all(self, req_id: str, groups: Iterable[int | None]) -> list[str]:
        """Each group's tracked id, recorded only once none of them clashes (`TrackedIdClash`), so a refusal
        records nothing."""
        made = [(tracked_id(req_id, group), group) for group in groups]
        for tracked, group in made:
            owner = self._owners.get(tracked, (req_id, group))
            if owner != (req_id, group):
                raise TrackedIdClash(f"request {req_id!r}'s group {group} would be tracked as {tracked!r}, the id "
                                     f"of request {owner[0]!r}'s group {owner[1]}: give the requests ids that differ "
                                     f"in more than a {SEPARATOR!r} suffix")
        self._owners.update((tracked, (req_id, group)) for tracked, group in made)
        self._ids.setdefault(req_id, set()).update(tracked for tracked, _ in made)
        return [tracked for tracked, _ in made]

    def owner(self, tracked: str) -> tuple[str, int | None]:
        """The request and group a tracked id was made for."""
        return self._owners[tracked]

    def forget(self, req_id: str) -> None:
        """The request's ids are no longer kvfsm's (it ended and nothing of it is left to report)."""
        for tracked in self._ids.pop(req_id, ()):
            del self._owners[tracked]

    def __len__(self) -> int:
        return len(self._owners)
