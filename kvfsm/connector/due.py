"""When each tracked request's next CPU block completes, and which batch of requests was last found quiet.

A decode step names every running request; in most steps none of them completes a CPU block, and the scheduler
half should then cost (nearly) nothing. The due points live beside the request records, in one dict, so a step
reads them all in one C-level pass. A quiet batch is remembered as its request ids and their due points: while no due
point moves and the engine names the same requests in the same order, the next step is checked by one tuple
comparison and two C passes over the token counts (a minimum, a comparison with the due points), without building
a set of the ids or reading the dict again.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence


class StoreDue:
    """Per tracked request, the computed-token count at which its next CPU block completes."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        """The due points: a step in which the engine reports fewer computed tokens has nothing of it to store."""
        self._quiet: tuple[tuple[str, ...], tuple[int, ...]] | None = None

    def set(self, req_id: str, tokens: int) -> None:
        self.tokens[req_id] = tokens
        self._quiet = None

    def forget(self, req_id: str) -> None:
        del self.tokens[req_id]
        self._quiet = None

    def of(self, req_ids: Sequence[str]) -> tuple[int, ...]:
        """The due points of `req_ids`, in one C call; a `KeyError` names an untracked one."""
        if len(req_ids) > 1:
            return operator.itemgetter(*req_ids)(self.tokens)  # type: ignore[no-any-return]
        return (self.tokens[req_ids[0]],)

    def remember_quiet(self, req_ids: tuple[str, ...], dues: tuple[int, ...]) -> None:
        """`req_ids` (checked: distinct and tracked) with these due points (`of(req_ids)`) made a quiet step."""
        self._quiet = (req_ids, dues)

    def known_quiet(self, req_ids: Sequence[str], computed: Sequence[int]) -> bool:
        """True when `req_ids` is the batch last remembered quiet, no due point moved since, and every computed count
        is at least 0 and below its due point: then the step names tracked requests, each once, and none completed
        a CPU block. False says only that the full check must decide. `computed` must be as long as `req_ids`."""
        quiet = self._quiet
        return (quiet is not None and quiet[0] == req_ids and min(computed) >= 0
                and all(map(operator.gt, quiet[1], computed)))
