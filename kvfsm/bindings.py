"""The bindings kvfsm ships: every guard, effect and invariant the spec names, and the spec checked against them.

`kvfsm.registry` defines the registry and the instance bindings register into, and imports nothing of kvfsm;
`kvfsm.records` and `kvfsm.tier_records` (guards and effects) and `kvfsm.invariants` (predicates) register when
imported. This module is the one place that imports them all, so the layers stay one-way: the spec loader is
handed a registry and never imports one, and the machines and the spec tooling ask here for the complete set.
"""

from __future__ import annotations

from functools import cache

import kvfsm.invariants  # noqa: F401  (registers the invariant predicates)
import kvfsm.fence_invariants  # noqa: F401  (registers the GPU blocks' fence invariant predicates)
import kvfsm.records  # noqa: F401  (registers the guards and effects)
import kvfsm.tier_invariants  # noqa: F401  (registers the lower tiers' invariant predicates)
import kvfsm.rank_invariants  # noqa: F401  (registers the tensor-parallel ranks' invariant predicates)
import kvfsm.group_invariants  # noqa: F401  (registers the KV-cache groups' invariant predicates)
import kvfsm.tier_records  # noqa: F401  (registers the lower tiers' guards and effects)
from kvfsm.registry import REGISTRY, Registry
from kvfsm.spec import DEFAULT_SPEC_DIR, Spec, load_spec


def default_registry() -> Registry:
    """The registry holding every binding kvfsm ships."""
    return REGISTRY


@cache
def default_spec() -> Spec:
    """The shipped lifecycles (`spec/`), loaded once and checked against the default registry."""
    return load_spec(DEFAULT_SPEC_DIR, registry=REGISTRY)
