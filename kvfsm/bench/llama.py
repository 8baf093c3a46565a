"""The benchmark's model: a Llama-shaped `transformers` model with attention an engine would run on a prefix hit.

Two things `transformers` does by default are not what a serving engine does with a reloaded prefix, and they cost
the 16-token tail more than the model itself:
- the tail's causal mask is materialised (the queries sit at the end of the keys, which SDPA's `is_causal` cannot
  say), which rules out the fused GQA kernels: every layer then copies K and V once per query-head group;
- `DynamicCache` concatenates the tail onto the prefix, copying the whole prefix again in every layer.
`causal_attention` states the mask as `causal_lower_right` (a fused kernel applies it, grouped-query attention stays
native) and `PrefixCache` holds each layer's prefix in a buffer sized for prefix + tail, filled layer by layer by
whoever supplies the prefix (here: the connector's per-layer load), so the tail is written in place.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

ATTENTION = "kvfsm_causal"


def causal_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **_: Any) -> tuple[torch.Tensor, None]:
    """Causal attention of queries that are the last `q` of the `s` keys, grouped-query heads kept native."""
    q, s = query.shape[2], key.shape[2]
    mask = causal_lower_right(q, s) if q != s else None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=q == s, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make `ATTENTION` an attention implementation `transformers` models can be built with (no mask is built
    for an implementation it does not know, which is what `causal_attention` wants)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, causal_attention)


class PrefixCache:
    """A `transformers` cache whose layer i holds a prefix of `prefix` tokens, filled by `fill(i)` just before layer
    i runs, then the tail written in place after it."""

    def __init__(self, model: Any, prefix: int, tail: int, fill: Callable[[int, torch.Tensor, torch.Tensor], None]):
        from transformers.cache_utils import Cache

        config = model.config
        shape = (1, config.num_key_value_heads, prefix + tail, config.head_dim)
        device, dtype = model.device, model.dtype
        layer_cls = _prefix_layer_class()
        self.layers = [layer_cls(torch.empty(shape, device=device, dtype=dtype),
                                 torch.empty(shape, device=device, dtype=dtype), prefix)
                       for _ in range(config.num_hidden_layers)]
        self.cache = Cache(layers=self.layers)
        self.prefix = prefix
        hooks = []
        for i, decoder in enumerate(model.model.layers):
            hooks.append(decoder.register_forward_pre_hook(
                lambda module, args, i=i: fill(i, self.layers[i].keys[:, :, :prefix], self.layers[i].values[:, :, :prefix])))
        self._hooks = hooks

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _prefix_layer_class() -> type:
    """`PrefixLayer`, defined once `transformers` is importable (it is only on machines that run the benchmark)."""
    from transformers.cache_utils import DynamicLayer

    class PrefixLayer(DynamicLayer):
        """One layer's K and V: the prefix already in place, the tail written after it."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, prefix: int) -> None:
            super().__init__()
            self.keys, self.values, self.length = keys, values, prefix
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            end = self.length + key_states.shape[-2]
            self.keys[:, :, self.length:end].copy_(key_states)
            self.values[:, :, self.length:end].copy_(value_states)
            self.length = end
            return self.keys[:, :, :end], self.values[:, :, :end]

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return self.keys.shape[-2]

    return PrefixLayer
