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
Replicated (MLA) KV stored once per host (`replicated`) has the workers share one host pool (`worker_side`). It is
the user's to ask for, and is served only where every rank holds the same KV on one host: an MLA model, tensor
parallelism the engine's only parallel axis (pipeline stages and context-parallel ranks hold different KV), one node,
no lower tier (not served under vLLM yet); elsewhere it is refused at start-up, in both halves, naming the reason. An
MLA model at TP>1 without it has every rank store its own copy of the latent, which the start-up log says.
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


class ReplicatedNotServed(InvalidExtraConfig):
    """`replicated` with several vLLM workers whose KV is not the same on every rank of one host (not an MLA model,
    pipeline or context parallelism, several nodes), or beside a lower tier: one shared copy would be wrong or would
    not be shared."""


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
    _check_replicated(config, vllm_config)
    return config


def _check_replicated(config: OffloadConfig, vllm_config: "VllmConfig") -> None:
    """Refuse `replicated` over several workers where the ranks' KV differs or would not be shared, naming why; say
    what an MLA model at TP>1 gets without it."""
    use_mla, parallel = vllm_config.model_config.use_mla, vllm_config.parallel_config
    if config.num_workers == 1:
        return
    if not config.replicated:
        if use_mla:
            log.warning("kvfsm: MLA KV over %d vLLM workers: every rank stores its own copy of the same latent (%d "
                        "times the PCIe bytes and host pool of one copy); replicated=true stores one, shared by the "
                        "ranks", config.num_workers, config.num_workers)
        return
    tp, dcp, nodes = parallel.tensor_parallel_size, parallel.decode_context_parallel_size, parallel.nnodes_within_dp
    reasons = [
        (not use_mla, "the model is not MLA: each rank holds its own heads' KV"),
        (parallel.world_size != tp, f"{parallel.world_size} workers are not {tp} tensor-parallel ranks (pipeline or "
                                    "prefill-context parallelism: the ranks hold different layers or tokens)"),
        (dcp > 1, f"decode-context parallelism ({dcp}) splits the KV by tokens"),
        (nodes > 1, f"the engine spans {nodes} nodes, and a host region is one host's"),
        (bool(config.lower_tiers), "lower tiers with replicated KV are not served under vLLM yet"),
    ]
    found = [reason for holds, reason in reasons if holds]
    if found:
        raise ReplicatedNotServed(f"kv_connector_extra_config sets replicated=true with {config.num_workers} vLLM "
                                  f"workers, but {'; '.join(found)}")


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
