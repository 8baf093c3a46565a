"""The benchmark's model: a Llama-shaped `transformers` model with attention an engine would run on a prefix hit.

Two things `transformers` does by default are not what a serving engine does with a reloaded prefix, and they cost
the 16-token tail more than the model itself:
- the tail's causal mask is materialised (the queries sit at the end of the keys, which SDPA's `is_causal` cannot
  say), which rules out the fused GQA kernels: every layer then copies K and V once per query-head group;
- `DynamicCache` concatenates the tail onto the prefix, copying the whole prefix again in every layer.
`causal_attention` states the mask as `causal_lower_right` (a fused kernel applies it, grouped-query attention stays
native), and `TailForward` holds each layer's prefix in a buffer sized for prefix + tail, filled layer by layer by
whoever supplies the prefix (here: the connector's per-layer load), so the tail is written in place; it also
launches the tail's kernels without eager `transformers`' per-layer host overhead.
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


class TailForward:
    """A Llama forward of the tokens after a loaded prefix, launched as a serving engine launches it: per layer the
    norms, projections, rotary embedding, one attention over prefix + tail and the MLP, straight from the
    `transformers` model's own weights. Eager `transformers` spends ~1.4 ms of host time per decoder layer on
    this host (wrappers, kwargs, cache objects, output hooks) to launch ~20 kernels: for a 16-token tail that is
    the whole reload at 8k tokens, a cost an engine with a lean or graph-captured forward does not pay.

    `fill(i, keys, values)` puts layer i's prefix into `keys`/`values` (views of that layer's buffer, sized for
    prefix + tail) just before layer i attends, which is where an engine waits for that layer's load."""

    def __init__(self, model: Any) -> None:
        self._model = model
        config = model.config
        self._kv_heads, self._head_dim = config.num_key_value_heads, config.head_dim
        if config.hidden_act != "silu":
            raise ValueError(f"TailForward runs Llama's SiLU MLP, the model's activation is {config.hidden_act!r}")

    @staticmethod
    def _norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        """Llama's RMSNorm, in float32 like `transformers`' own."""
        return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)

    def __call__(self, ids: torch.Tensor, prefix: int,
                 fill: Callable[[int, torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        """Logits of the last token of `ids` (1 x tail), whose first position is `prefix`."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        model, tail = self._model.model, ids.shape[1]
        x = F.embedding(ids, model.embed_tokens.weight)
        positions = torch.arange(prefix, prefix + tail, device=ids.device).unsqueeze(0)
        cos, sin = model.rotary_emb(x, positions)
        shape = (1, self._kv_heads, prefix + tail, self._head_dim)
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = self._norm(x, layer.input_layernorm)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(1, tail, -1, self._head_dim).transpose(1, 2)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(1, tail, -1, self._head_dim).transpose(1, 2)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(1, tail, -1, self._head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys = torch.empty(shape, dtype=x.dtype, device=x.device)
            values = torch.empty_like(keys)
            fill(i, keys[:, :, :prefix], values[:, :, :prefix])
            keys[:, :, prefix:].copy_(k)
            values[:, :, prefix:].copy_(v)
            out, _ = causal_attention(attn, q, keys, values, None, scaling=attn.scaling)
            x = x + F.linear(out.reshape(1, tail, -1), attn.o_proj.weight, attn.o_proj.bias)
            h = self._norm(x, layer.post_attention_layernorm)
            gate = F.silu(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
            x = x + F.linear(gate * F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight,
                             mlp.down_proj.bias)
        x = self._norm(x[:, -1:], model.norm)
        return F.linear(x, self._model.lm_head.weight)
