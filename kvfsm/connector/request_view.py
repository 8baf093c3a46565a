"""What the scheduler half reads of an engine's request: the shape an adapter converts its engine's requests to.

The vLLM adapter wraps each `Request` as one (`kvfsm.integrations.vllm.convert.RequestView`, and a view per KV-cache
group in `kvfsm.integrations.vllm.groups`); the reference engine's requests have the shape as they are. It lives
apart from the scheduler half, which plans with it, because adapters name it without needing the planning.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class RequestView(Protocol):
    """What the connector reads of an engine's request."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[int]:
        """Hash chain over the request's full GPU blocks (block i's hash covers tokens [0, (i+1)·block_size))."""

    @property
    def num_tokens(self) -> int:
        """Tokens the request holds; at its first lookup, its prompt (what `prompt-only` admission stores)."""
