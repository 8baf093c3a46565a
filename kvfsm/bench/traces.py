"""Synthetic request streams for comparing eviction policies, each generated deterministically from a seed.

A request is the chain of its blocks' prefix hashes (a block's hash stands for its whole prefix, so two requests
share a block exactly when they share everything before it) and how many of them are the prompt: a lookup covers
the prompt; the blocks after it are the output, stored like the prompt's and part of the next turn's prompt where
there is one. Block ids are fresh integers for new content and reused for shared content. Each trace also names
the pool size it is replayed against, `POOL_SHARE` of its distinct blocks, so every policy has to choose.

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
from typing import Callable, Iterator


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


def chat(seed: int, requests: int) -> Trace:
    rng, fresh = random.Random(seed), count(1)
    system = [next(fresh) for _ in range(4)]
    active: list[tuple[list[int], int]] = []  # (history, turns left)
    out = []
    while len(out) < requests:
        while len(active) < 24:
            active.append((list(system), rng.randint(2, 10)))
        i = rng.randrange(len(active))
        history, left = active[i]
        history.extend(next(fresh) for _ in range(rng.randint(1, 4)))  # the user's message
        prompt = len(history)
        history.extend(next(fresh) for _ in range(rng.randint(2, 8)))  # the answer
        out.append(Request(tuple(history), prompt))
        if left == 1:
            active.pop(i)
        else:
            active[i] = (history, left - 1)
    return Trace("chat", tuple(out), pool_blocks=_pool(out))


def agents(seed: int, requests: int) -> Trace:
    rng, fresh = random.Random(seed), count(1)
    systems = [[next(fresh) for _ in range(rng.randint(48, 96))] for _ in range(12)]
    weights = _zipf_weights(len(systems))
    runs: list[tuple[list[int], int]] = []
    out = []
    while len(out) < requests:
        while len(runs) < 16:
            runs.append((list(rng.choices(systems, weights)[0]), rng.randint(3, 12)))
        i = rng.randrange(len(runs))
        context, left = runs[i]
        context.extend(next(fresh) for _ in range(rng.randint(2, 6)))  # the last tool's output
        prompt = len(context)
        context.extend(next(fresh) for _ in range(rng.randint(1, 2)))  # the agent's next call
        out.append(Request(tuple(context), prompt))
        if left == 1:
            runs.pop(i)
        else:
            runs[i] = (context, left - 1)
    return Trace("agents", tuple(out), pool_blocks=_pool(out))


def _documents(rng: random.Random, fresh: Iterator[int], n: int, shortest: int, longest: int) -> list[list[int]]:
    return [[next(fresh) for _ in range(rng.randint(shortest, longest))] for _ in range(n)]


def _question(rng: random.Random, fresh: Iterator[int], document: list[int]) -> Request:
    prompt = document + [next(fresh)]
    return Request(tuple(prompt + [next(fresh) for _ in range(rng.randint(1, 4))]), len(prompt))


def zipf(seed: int, requests: int) -> Trace:
    rng, fresh = random.Random(seed), count(1)
    documents = _documents(rng, fresh, max(50, requests // 4), 8, 64)
    weights = _zipf_weights(len(documents))
    out = [_question(rng, fresh, rng.choices(documents, weights)[0]) for _ in range(requests)]
    return Trace("zipf", tuple(out), pool_blocks=_pool(out))


def scans(seed: int, requests: int) -> Trace:
    rng, fresh = random.Random(seed), count(1)
    documents = _documents(rng, fresh, max(30, requests // 10), 8, 48)
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
"""The pool holds this share of the distinct blocks a trace stores: small enough that every policy must choose."""


def _pool(requests: list[Request]) -> int:
    """`POOL_SHARE` of the distinct blocks the trace stores, at least 256 and at least its longest request."""
    distinct = len({h for r in requests for h in r.hashes})
    return max(256, max(len(r.hashes) for r in requests), int(distinct * POOL_SHARE))


TRACES: dict[str, Callable[[int, int], Trace]] = {"chat": chat, "agents": agents, "zipf": zipf, "scans": scans}
