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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
from pydantic import ValidationError

from kvfsm.config import OffloadConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class InvalidExtraConfig(ValueError):
    """`kv_connector_extra_config` names an unknown key, a bad value, or contradicts vLLM's own settings."""


class UnsupportedKVCache(ValueError):
    """vLLM's KV cache has a shape kvfsm cannot offload (several groups, or a layout it cannot tell)."""


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
    if any(tier.kind == "disk" for tier in config.lower_tiers):
        raise InvalidExtraConfig("a disk tier's index lives in the worker process, which vLLM's scheduler process "
                                 "cannot look up; use it with kvfsm.Connector (see docs/tiers.md)")
    return config


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
    """Bytes of one GPU block across every layer of the single offloaded group, as the workers will register it.

    vLLM gives a connector without hybrid-allocator support (kvfsm's) one group: it promotes sliding-window and
    chunked-local layers to full attention (every block kept, so every block can be offloaded and reloaded). Only
    a hand-built or hybrid-allocator configuration reaches here with several groups, and is refused by kind."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(f"{i}: {type(g.kv_cache_spec).__name__}" for i, g in enumerate(groups))
        raise UnsupportedKVCache(
            f"kvfsm offloads one KV-cache group; this configuration has {len(groups)} ({kinds}). Run vLLM with "
            "the hybrid KV-cache manager off (--disable-hybrid-kv-cache-manager, vLLM's default for kvfsm): "
            "sliding-window layers then keep every block and offload as full attention; state-space (Mamba) "
            "layers need the hybrid manager and are not supported")
    return groups[0].kv_cache_spec.page_size_bytes * len(groups[0].layer_names)


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
