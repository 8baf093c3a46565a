"""How a step's copies share the two copy engines: each direction's pieces sent in turns.

A step's stores and loads are lists of pieces, each one device operation (a store chunk, a load layer segment).
The copy engines run one direction each, but the host submits every piece in one thread, so the order it sends
them in decides when each engine starts.
"""

from __future__ import annotations

from typing import Callable, Sequence

Piece = tuple[int, Callable[[], None]]
"""One device operation of a step's copies, ready to send: the bytes it moves, and what sends it."""


def send_in_turns(*directions: Sequence[Piece]) -> None:
    """Send each direction's pieces in order, taking turns so that every direction has sent about the same share
    of its bytes at any moment (the smaller piece first on a tie). Sending one direction whole before the other
    left the second copy engine idle for the first's host submission: on the H100, 8 ms of a both-ways step."""
    totals = [sum(n for n, _ in pieces) or 1 for pieces in directions]
    sent = [0] * len(directions)
    taken = [0] * len(directions)
    while True:
        live = [d for d, pieces in enumerate(directions) if taken[d] < len(pieces)]
        if not live:
            return
        d = min(live, key=lambda d: (sent[d] / totals[d], directions[d][taken[d]][0]))
        nbytes, send = directions[d][taken[d]]
        taken[d] += 1
        sent[d] += nbytes
        send()
