"""kvfsm's configuration from vLLM's: the user's `kv_connector_extra_config`, checked against the engine.

Settings vLLM already decides (tokens per block, how many workers report each job, whether KV-cache events are
published) are taken from vLLM; a user who also sets them must agree with it, or start-up fails naming both values.
vLLM's own connector's `offload_prompt_only` is read as kvfsm's `admission`.
vLLM drains the connector's KV-cache events every step and publishes them only under `--kv-events-config
'{"enable_kv_cache_events": true}'`, so kvfsm records them (`kv_events`) exactly then. Every worker of the engine
reports each job: vLLM's `KVOutputAggregator` counts `parallel_config.world_size` of them (tensor x pipeline x
prefill-context parallel; pipeline stages other than the last pass their connector output through), so that is
`num_workers`. Whether vLLM schedules a step before it read the previous step's output is kvfsm's `async_scheduling`:
vLLM's engine core then keeps more than one batch in flight (`max_concurrent_batches`), under async scheduling (its
default where the platform and executor allow it) and with pipeline parallelism. With it on, `layer_loads` loads CPU
hits asynchronously (`no-inline-load-under-async-scheduling`), in both halves alike.
Replicated (MLA) KV stored once per host (`replicated`) needs the ranks to share one host pool; vLLM runs each worker
in a process of its own and the adapter does not share a pool between them yet, so `replicated` with several workers
is refused at start-up, in both halves; an MLA model at TP>1 then has every rank store its own copy of the latent
(TP times the PCIe bytes and host memory of one copy), which the start-up log says.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

import torch
from pydantic import ValidationError

from kvfsm.config import OffloadConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


class InvalidExtraConfig(ValueError):
    """`kv_connector_extra_config` names an unknown key, a bad value, or contradicts vLLM's own settings."""


class UnsupportedTier(InvalidExtraConfig):
    """A lower tier configured in a way that cannot work under vLLM's process split (see docs/vllm.md)."""


class ReplicatedNotShared(InvalidExtraConfig):
    """`replicated` with several vLLM workers: each is a process of its own, and the adapter gives them no host pool
    to share, so every worker would refuse to register (or pin a copy of its own, against the setting)."""


class UnsupportedKVCache(ValueError):
    """vLLM's KV cache has a shape kvfsm cannot offload (a group kind it does not serve, or a layout it cannot tell)."""


def offload_config(vllm_config: "VllmConfig") -> OffloadConfig:
    transfer = vllm_config.kv_transfer_config
    extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {}) if transfer is not None else {}
    events = vllm_config.kv_events_config
    from_engine = {
        "gpu_block_size": vllm_config.cache_config.block_size,
        "num_workers": vllm_config.parallel_config.world_size,
        "kv_events": events is not None and events.enable_kv_cache_events,
        "async_scheduling": vllm_config.max_concurrent_batches > 1,
    }
    _read_offload_prompt_only(extra)
    for key, value in from_engine.items():
        if key in extra and extra[key] != value:
            raise InvalidExtraConfig(f"kv_connector_extra_config sets {key}={extra[key]!r}, but vLLM runs with {value}")
        extra[key] = value
    try:
        config = OffloadConfig(**extra)
    except ValidationError as error:
        raise InvalidExtraConfig(f"kv_connector_extra_config is not a valid kvfsm OffloadConfig:\n{error}") from None
    _check_tiers(config, vllm_config.parallel_config.data_parallel_size)
    _check_replicated(config, vllm_config.model_config.use_mla)
    return config


def _check_replicated(config: OffloadConfig, use_mla: bool) -> None:
    """Refuse `replicated` over several workers by name, and say what an MLA model at TP>1 gets instead."""
    if config.replicated and config.num_workers > 1:
        raise ReplicatedNotShared(
            f"kv_connector_extra_config sets replicated=true with {config.num_workers} vLLM workers: each runs in a "
            "process of its own, and kvfsm's vLLM adapter does not share a host pool between them yet; leave "
            "replicated out (every rank then stores its own copy)")
    if use_mla and config.num_workers > 1:
        log.warning("kvfsm: MLA KV over %d vLLM workers: every rank stores its own copy of the same latent (%d "
                    "times the PCIe bytes and host pool of one copy); replicated KV shared by the ranks is not "
                    "served under vLLM yet", config.num_workers, config.num_workers)


def _check_tiers(config: OffloadConfig, data_parallel_size: int) -> None:
    """Refuse, by name, a lower tier that cannot work under vLLM's process split. A private disk tier (no `model_id`)
    keeps its blocks in a directory named by tier and rank (`private-<tier>-<rank>`), emptied when it opens, and every
    data-parallel engine numbers its ranks from 0: two engines would empty and overwrite each other's. A named disk
    tier is shared by design (its directory is its namespace's), so data-parallel engines may share it."""
    for tier in config.lower_tiers:
        if tier.kind == "disk" and tier.model_id is None and data_parallel_size > 1:
            raise UnsupportedTier(f"disk tier {tier.tier_name!r}: vLLM runs {data_parallel_size} data-parallel "
                                  f"engines, whose workers would empty each other's private directories in "
                                  f"{tier.path}; name the tier's model (model_id, kv_dtype) to share it")


def _read_offload_prompt_only(extra: dict[str, Any]) -> None:
    """vLLM's own connector's `offload_prompt_only` (a bool) read as kvfsm's `admission`, so one setting tells both;
    a contradicting `admission` beside it is refused. (`store_threshold` has the same name and meaning in both.)"""
    if "offload_prompt_only" not in extra:
        return
    prompt_only = extra.pop("offload_prompt_only")
    if not isinstance(prompt_only, bool):
        raise InvalidExtraConfig(f"kv_connector_extra_config sets offload_prompt_only={prompt_only!r}; legal: true "
                                 "or false (read as kvfsm's admission)")
    admission = "prompt-only" if prompt_only else "every-block"
    if extra.setdefault("admission", admission) != admission:
        raise InvalidExtraConfig(f"kv_connector_extra_config sets offload_prompt_only={prompt_only} and "
                                 f"admission={extra['admission']!r}; they contradict (give one)")


def gpu_block_bytes(kv_cache_config: "KVCacheConfig") -> int:
    """Bytes of one GPU block across every layer of a KV-cache group, as the workers will register it.

    Under vLLM's hybrid allocator every group's block is the same size (its tensors are shared by one layer of each
    group); `kvfsm.integrations.vllm.groups` refuses, by name, a configuration whose groups differ."""
    group = kv_cache_config.kv_cache_groups[0]
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)


def cache_layout(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> str:
    """kvfsm's layout name for vLLM's tensors, told apart by which axis has `num_blocks` entries."""
    shapes = {tuple(t.shape) for t in kv_caches.values()}
    layouts = set()
    for shape in shapes:
        fits = {
            "kv-first": len(shape) == 5 and shape[0] == 2 and shape[1] == num_blocks,
            "blocks-first": len(shape) == 5 and shape[0] == num_blocks and shape[1] == 2,
            "mla": len(shape) == 3 and shape[0] == num_blocks,
        }
        matches = [name for name, ok in fits.items() if ok]
        if len(matches) != 1:
            raise UnsupportedKVCache(f"cannot tell the layout of a KV cache shaped {shape} with {num_blocks} blocks "
                                     f"(candidates: {matches or 'none'})")
        layouts.update(matches)
    if len(layouts) != 1:
        raise UnsupportedKVCache(f"KV caches in several layouts: {sorted(layouts)}")
    return layouts.pop()
