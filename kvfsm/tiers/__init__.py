"""Lower tiers: stores below the CPU pool (a local disk here; Mooncake Store beside it), all behind `LowerTier`.

`kvfsm.tiers.base` is the interface, `kvfsm.tiers.entries` the index every tier keeps through the `tier-entry`
machine, `kvfsm.tiers.factory` opens the configured tiers. The connector's sides live with the connector:
`kvfsm.connector.tier_planner` (scheduler half: lookup across tiers, fetches, write-back policy) and
`kvfsm.connector.tier_runner` (worker half). The records are in `kvfsm.records`, the invariants in
`kvfsm.tier_invariants`.
"""
