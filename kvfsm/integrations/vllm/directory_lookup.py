"""The scheduler process asks a shared disk tier's directory which blocks other engines wrote, within a bounded wait.

A named disk tier (`DiskTierConfig.model_id`) keeps its blocks in its namespace's directory, where every engine of
that namespace on the host finds them, a restarted one included (`kvfsm.tiers.blockfile`). Under vLLM the scheduler
process plans fetches against its index of the tier (`tier_index.ReportedTier`), which hears only of its own workers'
write-backs; `DirectoryLookup` adds what the directory holds, as `MasterLookup` adds what a Mooncake master holds. A
key is offered only if every rank's directory holds its block file whole in size (a block is renamed into place only
once written, so a block torn by a crash is never there under its name), and only once every rank told the
scheduler its namespace and block bytes (`KeyScheme`, in the worker's first report): the directory's name depends on
the KV layout the worker registered, which the scheduler process never sees. The bytes are verified by the worker's
read (record and CRC-32); a block that fails it is a failed fetch, a miss.

Bounded as the tier's own lookup is (`kvfsm.tiers.bounded.BoundedCall`): the `stat`s run on a daemon thread of
their own and are waited at most `lookup_timeout_s` on the scheduler's thread; a late answer is a miss now, and
while a check is still running (a hung disk) every lookup is a miss at once, so a slow disk costs misses, never a
stalled scheduling step, nor a hung shut-down.

Threads: `present`, `learn` and `close` run on vLLM's scheduler thread; the `stat`s on the lookup's own thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from kvfsm.config import DiskTierConfig
from kvfsm.integrations.vllm.master_lookup import KeyScheme
from kvfsm.mooncake.keys import namespace_name
from kvfsm.tiers.blockfile import BlockFiles, DiskIo
from kvfsm.tiers.bounded import BoundedCall


class DirectoryLookup:
    """A named disk tier's directories, one per rank, as the scheduler's index of the tier asks them."""

    def __init__(self, config: DiskTierConfig, num_workers: int) -> None:
        self.path = Path(config.path)
        self.num_workers = num_workers
        self.ranks: dict[int, BlockFiles] = {}
        """Each rank's block files, from the namespace and block bytes its worker reported."""
        self._calls = BoundedCall(f"disk tier {config.tier_name!r} directory lookup", config.lookup_timeout_s)

    def learn(self, rank: int, scheme: KeyScheme) -> None:
        self.ranks[rank] = BlockFiles(self.path / namespace_name(scheme.namespace), scheme.namespace,
                                      scheme.block_bytes, DiskIo())

    def present(self, keys: Sequence[int]) -> int:
        """How many leading `keys` every rank's directory holds whole now; 0 until every rank's namespace is known,
        while an earlier check still runs, or when this one does not end within the bound."""
        if len(self.ranks) < self.num_workers or not keys:
            return 0
        ranks, asked = list(self.ranks.values()), tuple(keys)
        return self._calls(lambda: min(files.visible_prefix(asked) for files in ranks)) or 0

    def close(self) -> None:
        self._calls.close()
