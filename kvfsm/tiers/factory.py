"""Open the lower tiers an `OffloadConfig` names: one factory per tier kind, chosen by the config's `kind`.

Called once, on the worker's thread when it registers its KV caches, with the connector's machine set, which every
tier's entries fire on (there is no global set to fall back on).
"""

from __future__ import annotations

from typing import Callable

from kvfsm.config import DiskTierConfig, LowerTierConfig, MooncakeTierConfig
from kvfsm.io_executor import IoExecutor
from kvfsm.machines import MachineSet
from kvfsm.tiers.base import LowerTier, TierSite
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.io import io_threads

IoFactory = Callable[[LowerTierConfig], IoExecutor]
TierFactory = Callable[[LowerTierConfig, TierSite, IoExecutor | None, bool, MachineSet], LowerTier]
"""(tier config, site, executor override or None, keep lookups, the connector's machines) -> an open tier."""


def _open_disk(config: LowerTierConfig, site: TierSite, io: IoExecutor | None, keep_lookups: bool,
               machines: MachineSet) -> LowerTier:
    assert isinstance(config, DiskTierConfig)
    namespace = site.namespace(config.model_id, config.kv_dtype) if config.shared else None  # type: ignore[arg-type]
    return DiskTier(config.tier_name, config.path, config.capacity_bytes, site.block_bytes,
                    io or io_threads(config.io_threads, config.tier_name), worker=site.worker,
                    keep_lookups=keep_lookups, io_timeout_s=config.io_timeout_s, machines=machines,
                    namespace=namespace, lookup_timeout_s=config.lookup_timeout_s)


def _open_mooncake(config: LowerTierConfig, site: TierSite, io: IoExecutor | None, keep_lookups: bool,
                   machines: MachineSet) -> LowerTier:
    from kvfsm.tiers.mooncake import open_mooncake  # Mooncake is optional: loaded only when configured

    assert isinstance(config, MooncakeTierConfig)
    return open_mooncake(config, site, io, keep_lookups, machines)


TIER_FACTORIES: dict[str, TierFactory] = {"disk": _open_disk, "mooncake": _open_mooncake}
"""Tier kind -> factory. A new tier kind registers here and adds its config class to `LowerTierConfig`."""


def open_tiers(site: TierSite, io: IoFactory | None, keep_lookups: bool,
               machines: MachineSet) -> tuple[LowerTier, ...]:
    """Open every configured tier, in lookup order; if one fails to open, those opened are closed again."""
    opened: list[LowerTier] = []
    try:
        for tier in site.offload.lower_tiers:
            factory = TIER_FACTORIES[tier.kind]
            opened.append(factory(tier, site, io(tier) if io else None, keep_lookups, machines))
    except BaseException:
        for tier in opened:
            tier.close()
        raise
    return tuple(opened)
