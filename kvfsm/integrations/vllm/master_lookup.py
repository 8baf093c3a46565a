"""The scheduler process asks a Mooncake master which keys other engines wrote, within a bounded wait.

A Mooncake tier is shared: what another engine wrote back under the same model, dtype, layout, block size, ranks
and tenant is this engine's to fetch. Under vLLM the scheduler process plans fetches against its index of the tier
(`tier_index.ReportedTier`), which hears only of its own workers' write-backs; `MasterLookup` adds what the master
holds. A key is offered only if the master holds every value of the block (each rank's share under its rank's key,
or each KV head's under its head's key: `kvfsm.mooncake.keys`), and only once every rank told the scheduler how it
names them (`KeyScheme`): the layout part of a key is derived from the KV caches a worker registered, which the
scheduler process never sees (`KvfsmWorkerMetadata.namespaces`, sent with each worker's first report). Until then a
lookup finds only what this engine wrote. The client needs the tenant's secret as the workers' do (it only asks which
keys exist), so a missing secret stops the scheduler at start-up too.

Bounded: one `batch_is_exist` per lookup, waited at most `lookup_timeout_s` on the scheduler's thread; a late or
failed answer is a miss now (the client then refuses calls at once for `retry_after_s`, so a dead master costs
misses, never a stalled scheduling step). The client lends the store no memory (`segment_bytes=0`) and moves no
bytes: the workers fetch.

Threads: `present` and `learn` run on vLLM's scheduler thread; the query runs on the client's lookup thread.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

from kvfsm.config import MooncakeTierConfig
from kvfsm.mooncake.client import MooncakeClient
from kvfsm.mooncake.errors import TierFault
from kvfsm.mooncake.keys import KvNamespace, head_key, object_key
from kvfsm.mooncake.local import MasterAddress
from kvfsm.mooncake.secret import load_value_key
from kvfsm.mooncake.settings import ClientSettings
from kvfsm.mooncake.value import ValueMac

log = logging.getLogger(__name__)


class KeyScheme(NamedTuple):
    """How one rank names a block's values in the store: its namespace and, when values are per KV head, the
    model's KV heads (every head's value is then the block's, whichever rank wrote it). A shared disk tier's rank
    sends its namespace (which names its directory) and its block bytes (a whole block file's size, less the
    record: `directory_lookup`)."""

    namespace: KvNamespace
    kv_heads: int | None = None
    block_bytes: int = 0

    def names(self, key: int, tenant: str | None) -> list[str]:
        """The store keys that together hold this rank's view of a whole block."""
        if self.kv_heads is None:
            return [object_key(self.namespace, key, tenant)]
        return [head_key(self.namespace, key, head, tenant) for head in range(self.kv_heads)]


class MasterLookup:
    def __init__(self, config: MooncakeTierConfig, num_workers: int) -> None:
        """Connect to the configured master (bounded by the client's connect timeout): an unreachable master is
        `StoreUnavailable` at vLLM's start-up, in the scheduler process, before any worker pins memory."""
        self.name = config.tier_name
        self.tenant = config.tenant
        self.timeout_s = config.lookup_timeout_s
        self.num_workers = num_workers
        self.schemes: dict[int, KeyScheme] = {}
        """Each rank's key scheme, as its worker reported it."""
        mac = ValueMac(load_value_key(config.secret_file, config.secret_env, config.tenant))
        self.client = MooncakeClient(ClientSettings(
            master=MasterAddress.parse(config.master), segment_bytes=0, op_timeout_s=config.op_timeout_s,
            retry_after_s=config.retry_after_s, max_pending=config.max_pending), mac)
        self.client.connect()

    def learn(self, rank: int, scheme: KeyScheme) -> None:
        self.schemes[rank] = scheme

    def present(self, keys: Sequence[int]) -> int:
        """How many leading `keys` the master holds whole now (every value of every rank's view); 0 until every
        rank's scheme is known, or when the master does not answer within the bound."""
        if len(self.schemes) < self.num_workers or not keys:
            return 0
        per_key = [list(dict.fromkeys(name for scheme in self.schemes.values()
                                      for name in scheme.names(key, self.tenant))) for key in keys]
        answers = self.client.contains([name for names in per_key for name in names]).wait(self.timeout_s)
        if answers is None:
            log.warning("mooncake tier %s: the master did not answer within %ss; counted as a miss", self.name,
                        self.timeout_s)
            return 0
        count, start = 0, 0
        for names in per_key:
            share, start = answers[start:start + len(names)], start + len(names)
            if not all(answer is True for answer in share):
                faults = [a for a in share if isinstance(a, TierFault)]
                if faults:
                    log.warning("mooncake tier %s: lookup: %s: %s", self.name, type(faults[0]).__name__, faults[0])
                break
            count += 1
        return count

    def close(self) -> None:
        self.client.close()
