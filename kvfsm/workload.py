"""Traffic whose prefixes come back after the GPU has forgotten them: what KV offloading exists for.

Two kinds of session, both re-sending everything they sent before:
- a *conversation* is a short system prompt followed by turns; turn t's prompt is turn t-1's prompt plus the
  user's new message, as a chat front end re-sends the whole history each turn;
- an *agent* starts from one long prefix that every agent shares (tool descriptions, instructions), adds its own
  task, and then calls the model repeatedly, each call the previous one plus a tool result.

Sessions start staggered and pause between turns ("think time"), so many are open at once and their prefixes
outgrow a small GPU KV cache. Arrival steps are fixed by the seed, never by how fast an engine serves: two engines
fed the same workload receive the same requests in the same order, so their outputs compare by handle.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


class WorkloadError(ValueError):
    """A workload shape that cannot produce a request (a count or a length below one)."""


@dataclass(frozen=True)
class Arrival:
    """One request, and the engine step before which it is submitted."""

    step: int
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class WorkloadShape:
    conversations: int = 16
    turns: int = 6
    """Turns per conversation, and calls per agent."""
    agents: int = 8
    system_tokens: int = 24
    """A conversation's own system prompt."""
    message_tokens: int = 24
    """New tokens a conversation turn adds (the user's message)."""
    shared_prefix_tokens: int = 128
    """The prefix every agent shares."""
    task_tokens: int = 16
    """An agent's own task, after the shared prefix."""
    tool_result_tokens: int = 16
    """New tokens an agent call adds (the previous tool result)."""
    output_tokens: int = 4
    """Tokens sampled per request."""
    stagger_steps: int = 3
    """Steps between the starts of consecutive sessions."""
    think_steps: int = 24
    """Mean steps between a session's turns; each gap is drawn within ±50% of it."""

    def __post_init__(self) -> None:
        for name in ("turns", "system_tokens", "message_tokens", "shared_prefix_tokens", "task_tokens",
                     "tool_result_tokens", "output_tokens", "stagger_steps", "think_steps"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("conversations", "agents"):
            if getattr(self, name) < 0:
                raise WorkloadError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.conversations + self.agents == 0:
            raise WorkloadError("the workload needs at least one conversation or agent")


def generate(shape: WorkloadShape, vocab: int, seed: int) -> list[Arrival]:
    """Every request of the workload, sorted by arrival step (ties keep session order)."""
    rng = random.Random(seed)

    def tokens(count: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(count))

    shared = tokens(shape.shared_prefix_tokens)
    sessions = [(f"conv{i}", tokens(shape.system_tokens), shape.message_tokens)
                for i in range(shape.conversations)]
    sessions += [(f"agent{i}", shared + tokens(shape.task_tokens), shape.tool_result_tokens)
                 for i in range(shape.agents)]
    rng.shuffle(sessions)  # conversations and agents interleave
    arrivals = []
    for index, (name, context, growth) in enumerate(sessions):
        step = index * shape.stagger_steps
        for turn in range(shape.turns):
            context = context + tokens(growth)
            arrivals.append(Arrival(step, f"{name}-turn{turn}", context, shape.output_tokens))
            step += rng.randint(max(1, shape.think_steps // 2), shape.think_steps * 3 // 2)
    arrivals.sort(key=lambda a: a.step)
    return arrivals


def minimum_compute(arrivals: list[Arrival], block_size: int) -> int:
    """Tokens an engine with an unbounded prefix cache computes: each distinct full prompt block once, the rest
    of every prompt, and every sampled token after the first (whose KV the next position needs)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for arrival in arrivals:
        prompt = arrival.prompt
        computable = (len(prompt) - 1) // block_size  # the last prompt token is always computed, for its logits
        hits = 0
        while hits < computable and prompt[:(hits + 1) * block_size] in seen:
            hits += 1
        seen.update(prompt[:(i + 1) * block_size] for i in range(len(prompt) // block_size))
        total += len(prompt) - hits * block_size + arrival.max_new_tokens - 1
    return total
