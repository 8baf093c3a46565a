"""The connector's named refusals: one exception per way a public call can be illegal.

All derive from `IllegalCall` (a `ValueError`), so a caller can catch every refusal at once, and some also from the
builtin a caller would expect (`KeyError` for an unknown id, `IndexError` for a block id out of range). The checks
that raise them are in `validation`; a refused call changed nothing.
"""

from __future__ import annotations


class IllegalCall(ValueError):
    """A public connector call with an illegal argument; the connector did not change."""

    __str__ = BaseException.__str__  # subclasses that are also KeyErrors keep a readable message


class WrongType(IllegalCall, TypeError):
    """An argument is not of the type the call takes (a dict where an `OffloadConfig` belongs, say)."""


class NotPositive(IllegalCall):
    """A size or a count that must be 1 or more is not."""


class MalformedRequest(IllegalCall):
    """A request whose id, token count or block hashes cannot describe a request."""


class UnknownRequest(IllegalCall, KeyError):
    """The engine named a request the connector never saw (or already released)."""


class RequestStateForbids(IllegalCall):
    """The request's lifecycle state has no transition for what the call asks (the spec decides)."""


class NegativeTokenCount(IllegalCall):
    """A token count below zero."""


class TokenCountBeyondRequest(IllegalCall):
    """More computed tokens than the request has."""


class UnalignedTokenCount(IllegalCall):
    """External tokens are loaded in whole GPU blocks; a count that is not a multiple of the block size."""


class MoreTokensThanOffered(IllegalCall):
    """The engine accepted more external tokens than the lookup offered."""


class BlockIdOutOfRange(IllegalCall, IndexError):
    """A GPU block id outside the registered KV cache."""


class DuplicateBlockIds(IllegalCall):
    """One request names the same GPU block twice: a store or load of it would be lost."""


class TooFewBlocks(IllegalCall):
    """The blocks allocated to a request do not cover the external tokens it accepted."""


class StaleMatch(IllegalCall):
    """A request was allocated external tokens its lookup offered, but the CPU blocks behind them left the pool
    since (a call between the lookup and the allocation made room): it must be looked up again."""


class ContradictoryStep(IllegalCall):
    """A step names a request twice, both preempts and schedules it, or has columns of different lengths."""


class NotRegistered(IllegalCall, RuntimeError):
    """The scheduler half was used, or a transfer ordered, before `register_kv_caches`."""


class StoreBytesNotKept(IllegalCall):
    """`WorkerConnector.store_bytes` was read from a worker built without `keep_store_bytes`."""


class UnknownJob(IllegalCall, KeyError):
    """A worker reported a job the scheduler does not have in flight for it, or reported it twice."""


class UnknownWorker(IllegalCall):
    """A report from a worker rank outside `[0, num_workers)`."""


class ReusedJobId(IllegalCall):
    """The worker was ordered a job whose id it still has in flight."""


class AlreadyRegistered(IllegalCall):
    """`register_kv_caches` ran twice: a second pinned pool would orphan the first one's jobs."""


class BlockSizeMismatch(IllegalCall):
    """The KV cache pages a different number of tokens per block than `OffloadConfig.gpu_block_size` says."""


# --- arguments --------------------------------------------------------------------------------------------
