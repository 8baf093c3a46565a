"""Synthetic request streams for comparing eviction policies, each generated deterministically from a seed.

A request is the chain of its blocks' prefix hashes (a block's hash stands for its whole prefix, so two requests
share a block exactly when they share everything before it) and how many of them are the prompt: a lookup covers
the prompt; the blocks after it are the output, stored like the prompt's and part of the next turn's prompt where
there is one. Block ids are fresh integers for new content and reused for shared content. Each trace also names
the pool size it is replayed against (`POOL_SHARE` of the distinct blocks of its first `WINDOW` requests), so every
policy has to choose.

- `chat`: multi-turn conversations over one short shared system prompt; each turn re-reads the whole history.
- `agents`: agent runs sharing a few long system prompts (Zipf-popular), each run a loop of tool steps whose
  context grows.
- `zipf`: documents of varied length asked about by Zipf popularity, each question and answer unique.
- `scans`: a hot Zipf mix like `zipf`, interleaved with one-shot long documents never seen again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import count
from typing import Callable, Iterator, Sequence


@dataclass(frozen=True)
class Request:
    hashes: tuple[int, ...]
    prompt_blocks: int


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[Request, ...]
    pool_blocks: int


def _zipf_weights(n: int, exponent: float = 1.0) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(n)]


def _sessions(rng: random.Random, fresh: Iterator[int], requests: int, concurrent: int,
              start: Callable[[], tuple[list[int], int]], prompt: tuple[int, int],
              output: tuple[int, int]) -> tuple[Request, ...]:
    """`concurrent` sessions at a time, each `start()`ed as (context, turns) and taking turns in random order: a
    turn appends `prompt` new blocks (a message, a tool's output), looks the whole context up, then appends
    `output` blocks (the answer) that the next turn's prompt includes."""
    active: list[tuple[list[int], int]] = []
    out = []
    while len(out) < requests:
        while len(active) < concurrent:
            active.append(start())
        i = rng.randrange(len(active))
        context, left = active[i]
        context.extend(next(fresh) for _ in range(rng.randint(*prompt)))
        prompt_blocks = len(context)
        context.extend(next(fresh) for _ in range(rng.randint(*output)))
        out.append(Request(tuple(context), prompt_blocks))
        if left == 1:
            active.pop(i)
        else:
            active[i] = (context, left - 1)
    return tuple(out)


def chat(seed: int, requests: int) -> Trace:
    """24 conversations at a time over one 4-block system prompt, 2 to 10 turns each."""
    rng, fresh = random.Random(seed), count(1)
    system = [next(fresh) for _ in range(4)]
    out = _sessions(rng, fresh, requests, 24, lambda: (list(system), rng.randint(2, 10)), (1, 4), (2, 8))
    return Trace("chat", out, pool_blocks=_pool(out))


def agents(seed: int, requests: int) -> Trace:
    """16 agent runs at a time, each on one of 12 system prompts of 48 to 96 blocks (Zipf-popular), 3 to 12 steps."""
    rng, fresh = random.Random(seed), count(1)
    systems = [[next(fresh) for _ in range(rng.randint(48, 96))] for _ in range(12)]
    weights = _zipf_weights(len(systems))
    out = _sessions(rng, fresh, requests, 16, lambda: (list(rng.choices(systems, weights)[0]), rng.randint(3, 12)),
                    (2, 6), (1, 2))
    return Trace("agents", out, pool_blocks=_pool(out))


def _documents(rng: random.Random, fresh: Iterator[int], n: int, shortest: int, longest: int) -> list[list[int]]:
    return [[next(fresh) for _ in range(rng.randint(shortest, longest))] for _ in range(n)]


def _question(rng: random.Random, fresh: Iterator[int], document: list[int]) -> Request:
    prompt = document + [next(fresh)]
    return Request(tuple(prompt + [next(fresh) for _ in range(rng.randint(1, 4))]), len(prompt))


def zipf(seed: int, requests: int) -> Trace:
    """Questions on 300 documents of 8 to 64 blocks, by Zipf popularity; each question and answer is unique."""
    rng, fresh = random.Random(seed), count(1)
    documents = _documents(rng, fresh, 300, 8, 64)
    weights = _zipf_weights(len(documents))
    out = [_question(rng, fresh, rng.choices(documents, weights)[0]) for _ in range(requests)]
    return Trace("zipf", tuple(out), pool_blocks=_pool(out))


def scans(seed: int, requests: int) -> Trace:
    """A Zipf mix of 120 documents of 8 to 48 blocks, and three requests in ten a one-shot document of 64 to 128."""
    rng, fresh = random.Random(seed), count(1)
    documents = _documents(rng, fresh, 120, 8, 48)
    weights = _zipf_weights(len(documents))
    out = []
    for _ in range(requests):
        if rng.random() < 0.3:
            scan = [next(fresh) for _ in range(rng.randint(64, 128))]
            out.append(Request(tuple(scan + [next(fresh)]), len(scan)))
        else:
            out.append(_question(rng, fresh, rng.choices(documents, weights)[0]))
    return Trace("scans", tuple(out), pool_blocks=_pool(out))


POOL_SHARE = 0.06
WINDOW = 1000
"""The pool holds `POOL_SHARE` of the distinct blocks of a trace's first `WINDOW` requests: small enough that every
policy must choose, and the same whatever the trace's length (a longer replay only steadies the figures)."""


def _pool(requests: Sequence[Request]) -> int:
    """At least 256 slots and at least the longest request."""
    distinct = len({h for r in requests[:WINDOW] for h in r.hashes})
    return max(256, max(len(r.hashes) for r in requests), int(distinct * POOL_SHARE))


TRACES: dict[str, Callable[[int, int], Trace]] = {"chat": chat, "agents": agents, "zipf": zipf, "scans": scans}
