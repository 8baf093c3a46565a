"""The scheduler process asks a Mooncake master which keys other engines wrote, within a bounded wait.

A Mooncake tier is shared: what another engine wrote back under the same model, dtype, layout, block size, ranks
and tenant is this engine's to fetch. Under vLLM the scheduler process plans fetches against its index of the tier
(`tier_index.ReportedTier`), which hears only of its own workers' write-backs; `MasterLookup` adds what the master
holds. A key is offered only if the master holds it for every rank (each rank stores its own share under its own key,
`kvfsm.mooncake.keys`), and only once every rank told the scheduler its key namespace: the layout part of it is
derived from the KV caches a worker registered, which the scheduler process never sees (`KvfsmWorkerMetadata.
namespaces`, sent with each worker's first report). Until then a lookup finds only what this engine wrote.

Bounded: one `batch_is_exist` per lookup, waited at most `lookup_timeout_s` on the scheduler's thread; a late or
failed answer is a miss now (the client then refuses calls at once for `retry_after_s`, so a dead master costs
misses, never a stalled scheduling step). The client lends the store no memory (`segment_bytes=0`) and moves no
bytes: the workers fetch.

Threads: `present` and `learn` run on vLLM's scheduler thread; the query runs on the client's lookup thread.
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvfsm.config import MooncakeTierConfig
from kvfsm.mooncake.client import ClientSettings, MooncakeClient
from kvfsm.mooncake.errors import TierFault
from kvfsm.mooncake.keys import KvNamespace, object_key
from kvfsm.mooncake.local import MasterAddress

log = logging.getLogger(__name__)


class MasterLookup:
    def __init__(self, config: MooncakeTierConfig, num_workers: int) -> None:
        """Connect to the configured master (bounded by the client's connect timeout): an unreachable master is
        `StoreUnavailable` at vLLM's start-up, in the scheduler process, before any worker pins memory."""
        self.name = config.tier_name
        self.tenant = config.tenant
        self.timeout_s = config.lookup_timeout_s
        self.num_workers = num_workers
        self.namespaces: dict[int, KvNamespace] = {}
        """Each rank's key namespace, as its worker reported it."""
        self.client = MooncakeClient(ClientSettings(
            master=MasterAddress.parse(config.master), segment_bytes=0, op_timeout_s=config.op_timeout_s,
            retry_after_s=config.retry_after_s, max_pending=config.max_pending))
        self.client.connect()

    def learn(self, rank: int, namespace: KvNamespace) -> None:
        self.namespaces[rank] = namespace

    def present(self, keys: Sequence[int]) -> int:
        """How many leading `keys` the master holds for every rank now; 0 until every rank's namespace is known,
        or when the master does not answer within the bound."""
        if len(self.namespaces) < self.num_workers or not keys:
            return 0
        ranks = sorted(self.namespaces)
        names = [object_key(self.namespaces[rank], key, self.tenant) for key in keys for rank in ranks]
        answers = self.client.contains(names).wait(self.timeout_s)
        if answers is None:
            log.warning("mooncake tier %s: the master did not answer within %ss; counted as a miss", self.name,
                        self.timeout_s)
            return 0
        count = 0
        for i in range(len(keys)):
            share = answers[i * len(ranks):(i + 1) * len(ranks)]
            if not all(answer is True for answer in share):
                faults = [a for a in share if isinstance(a, TierFault)]
                if faults:
                    log.warning("mooncake tier %s: lookup: %s: %s", self.name, type(faults[0]).__name__, faults[0])
                break
            count += 1
        return count

    def close(self) -> None:
        self.client.close()
