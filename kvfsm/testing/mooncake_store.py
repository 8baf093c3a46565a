"""The Mooncake tier under generated interleavings: one shared local deployment, the store's faults, the mutants.

Every example that draws the Mooncake tier talks to a real `mooncake_master` (started once per process, on
loopback, stopped at exit and killed with the process) under a tenant of its own, so examples never see each
other's keys. Faults are produced where real ones arise, in the store: a value overwritten with other bytes, an
object removed (store-side eviction, an expired lease), and an engine forgetting what it published so that its
next lookup must adopt keys from the store.
"""

from __future__ import annotations

import atexit
from typing import Callable, Sequence

from kvfsm.connector import Connector
from kvfsm.engine.engine import Engine
from kvfsm.mooncake import available
from kvfsm.mooncake.local import DeploymentSettings, LocalMooncake
from kvfsm.mooncake.secret import ValueKey
from kvfsm.mooncake.value import ValueMac
from kvfsm.tier_records import TierEntry
from kvfsm.states import TierEntryState as Entry
from kvfsm.tiers.mooncake import MooncakeTier

_shared: LocalMooncake | None = None


def shared_master() -> str | None:
    """HOST:PORT of this process's shared deployment, started on first use; None when Mooncake is not installed."""
    global _shared
    if not available():
        return None
    if _shared is None:
        _shared = LocalMooncake(DeploymentSettings(segment_bytes=256 << 20))
        _shared.start()
        atexit.register(_shared.close)
    return str(_shared.address)


def tenant_mac(secret: bytes = b"a test tenant's secret, 32 bytes or more", tenant: str | None = None) -> ValueMac:
    """The sealer of a tenant holding `secret`, for clients a test makes itself (one tenant unless it passes
    another secret)."""
    return ValueMac(ValueKey.derive(secret, tenant))


def tier_of(connector: Connector) -> MooncakeTier | None:
    return next((t for t in connector.worker.lower_tiers if isinstance(t, MooncakeTier)), None)


class MooncakeFaults:
    """Faults of a shared store, applied to the real store under one engine's Mooncake tier."""

    def __init__(self, tier: MooncakeTier | None) -> None:
        self.tier = tier
        self.corrupted: set[int] = set()
        """Keys whose stored value was overwritten on purpose: their fetch must fail, never load."""
        self.removed: set[int] = set()
        """Keys removed from the store on purpose: a published entry may outlive its object (a miss later)."""

    def _published(self) -> list[TierEntry]:
        assert self.tier is not None
        return sorted((e for e in self.tier.entries if e.state in (Entry.PUBLISHED, Entry.READING)), key=lambda e: e.key)

    def corrupt_value(self, choice: int) -> None:
        """Another writer puts other bytes (a flipped byte) under a published key."""
        published = self._published() if self.tier is not None else []
        if not published:
            return
        key = published[choice % len(published)].key
        names = self.tier.store_keys(key)  # type: ignore[union-attr]  # one per head with `kv_heads`: spoil one
        store, name = self.tier.client.raw(), names[choice % len(names)]  # type: ignore[union-attr]
        raw = bytearray(store.get(name))
        if not raw:
            return
        raw[choice % len(raw)] ^= 0xFF
        store.remove(name, True)
        store.put(name, bytes(raw))
        self.corrupted.add(key)

    def remove_in_store(self, choice: int) -> None:
        """The store drops a published key (its eviction, a lease that ran out): a later fetch finds it missing."""
        published = self._published() if self.tier is not None else []
        if not published:
            return
        key = published[choice % len(published)].key
        names = self.tier.store_keys(key)  # type: ignore[union-attr]  # one per head with `kv_heads`: drop one
        self.tier.client.raw().remove(names[choice % len(names)], True)  # type: ignore[union-attr]
        self.removed.add(key)

    def forget(self, choice: int) -> None:
        """The engine forgets what it published (a cache reset does this): its next lookup adopts from the store."""
        if self.tier is not None:
            self.tier.discard([e.key for e in self._published() if e.state == Entry.PUBLISHED])


def _tier(connector: Connector) -> MooncakeTier:
    tier = tier_of(connector)
    assert tier is not None, "a Mooncake mutant needs the Mooncake tier"
    return tier


def adopt_unasked(engine: Engine, connector: Connector) -> None:
    """A lookup adopts every key it does not know without asking the store whether the store holds it."""
    tier = _tier(connector)

    def adopt_all(keys: Sequence[int]) -> None:
        for key in keys:
            if tier.entries.get(key) is None:
                tier.entries.adopt(key)

    tier._adopt_from_store = adopt_all  # type: ignore[method-assign]


def unchecked_fetch(engine: Engine, connector: Connector) -> None:
    """Values read from the store are taken without checking their MAC: a corrupted, forged or foreign value goes to
    the GPU, and one planted under a key a write-back finds present is published. The control of
    `tests/mooncake/test_mooncake_tier.py`'s corrupted- and forged-value tests (a generated interleaving reaches a
    corrupted fetch too rarely for the mutant hunt's budget)."""
    _tier(connector).client.verify_value = lambda trailer, key, payload: None


MOONCAKE_MUTANTS: tuple[tuple[str, str, Callable[[Engine, Connector], None]], ...] = (
    ("mooncake-adopt-unasked", "publish-after-write (a key adopted that the shared store does not hold)",
     adopt_unasked),
)
