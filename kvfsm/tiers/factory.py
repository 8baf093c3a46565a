"""Open the lower tiers an `OffloadConfig` names: one factory per tier kind, chosen by the config's `kind`."""

from __future__ import annotations

from typing import Callable

from kvfsm.config import DiskTierConfig, LowerTierConfig, OffloadConfig
from kvfsm.machines import MachineSet
from kvfsm.tiers.base import IoExecutor, LowerTier
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.io import io_threads

IoFactory = Callable[[LowerTierConfig], IoExecutor]
TierFactory = Callable[[LowerTierConfig, int, int, IoExecutor | None, bool, MachineSet | None], LowerTier]
"""(tier config, CPU block bytes, worker index, executor override or None, keep lookups, the connector's machines)
-> an open tier."""


def _open_disk(config: LowerTierConfig, block_bytes: int, worker: int, io: IoExecutor | None,
               keep_lookups: bool, machines: MachineSet | None) -> LowerTier:
    assert isinstance(config, DiskTierConfig)
    return DiskTier(config.tier_name, config.path, config.capacity_bytes, block_bytes,
                    io or io_threads(config.io_threads, config.tier_name), worker=worker, keep_lookups=keep_lookups,
                    io_timeout_s=config.io_timeout_s, machines=machines)


TIER_FACTORIES: dict[str, TierFactory] = {"disk": _open_disk}
"""Tier kind -> factory. A new tier kind registers here and adds its config class to `LowerTierConfig`."""


def open_tiers(config: OffloadConfig, block_bytes: int, worker: int = 0, io: IoFactory | None = None,
               keep_lookups: bool = False, machines: MachineSet | None = None) -> tuple[LowerTier, ...]:
    """Open every configured tier, in lookup order; if one fails to open, those opened are closed again."""
    opened: list[LowerTier] = []
    try:
        for tier in config.lower_tiers:
            factory = TIER_FACTORIES[tier.kind]
            opened.append(factory(tier, block_bytes, worker, io(tier) if io else None, keep_lookups, machines))
    except BaseException:
        for tier in opened:
            tier.close()
        raise
    return tuple(opened)
