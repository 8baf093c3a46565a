"""Lower tiers: stores below the CPU pool (a local disk here; Mooncake Store beside it), all behind `LowerTier`.

`kvfsm.tiers.base` is the interface and the job bookkeeping every tier shares (`TierJobs`: jobs in flight, their
deadline, the poll loop), `kvfsm.tiers.entries` the index every tier keeps through the `tier-entry` machine,
`kvfsm.tiers.factory` opens the configured tiers, `kvfsm.tiers.io` holds the executors their blocking I/O runs on
(`kvfsm.io_executor.IoExecutor`). The connector's sides live with the connector:
`kvfsm.connector.tier_planner` (scheduler half: lookup across tiers, fetches, write-back policy) and
`kvfsm.connector.tier_runner` (worker half). The records are in `kvfsm.records`, the invariants in
`kvfsm.tier_invariants`.
"""
