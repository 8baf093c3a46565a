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

    On a GPU each layer's kernels before and after its attention's prefix are replayed as two CUDA graphs, captured
    on the first call for each (prefix, tail) shape, as engines capture their forward piecewise around attention.
    Launched one by one, this forward's ~600 kernels still took ~20 ms of host time on an H100 host, twice the
    GPU's time for a 16-token tail, and up to ~35 ms in the host's slow intervals (a 2k-token reload took 24 ms
    against a 5 ms floor; 8k-token reloads ranged over 23-48 ms).

    `fill(i, keys, values)` puts layer i's prefix into `keys`/`values` (views of that layer's buffer, sized for
    prefix + tail) just before layer i attends, which is where an engine waits for that layer's load: it runs
    between the two graphs, on the same stream."""

    def __init__(self, model: Any) -> None:
        self._model = model
        config = model.config
        self._kv_heads, self._head_dim = config.num_key_value_heads, config.head_dim
        if config.hidden_act != "silu":
            raise ValueError(f"TailForward runs Llama's SiLU MLP, the model's activation is {config.hidden_act!r}")
        self._captured: dict[tuple[int, int], _LayerGraphs] = {}

    @staticmethod
    def _norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        """Llama's RMSNorm, in float32 like `transformers`' own."""
        return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)

    def _rotary(self, x: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(prefix, prefix + x.shape[1], device=x.device).unsqueeze(0)
        return self._model.model.rotary_emb(x, positions)

    def _buffers(self, x: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self._kv_heads, prefix + x.shape[1], self._head_dim)
        keys = torch.empty(shape, dtype=x.dtype, device=x.device)
        return keys, torch.empty_like(keys)

    def before_attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor) -> torch.Tensor:
        """Layer i up to its attention: the queries, with the tail's keys and values written after the prefix."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer, tail = self._model.model.layers[i], x.shape[1]
        attn = layer.self_attn
        h = self._norm(x, layer.input_layernorm)
        q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(1, tail, -1, self._head_dim).transpose(1, 2)
        k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(1, tail, -1, self._head_dim).transpose(1, 2)
        v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(1, tail, -1, self._head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys[:, :, -tail:].copy_(k)
        values[:, :, -tail:].copy_(v)
        return q

    def after_attention(self, i: int, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor) -> torch.Tensor:
        """Layer i from its attention over prefix + tail on: the layer's output."""
        layer, tail = self._model.model.layers[i], x.shape[1]
        attn, mlp = layer.self_attn, layer.mlp
        out, _ = causal_attention(attn, q, keys, values, None, scaling=attn.scaling)
        x = x + F.linear(out.reshape(1, tail, -1), attn.o_proj.weight, attn.o_proj.bias)
        h = self._norm(x, layer.post_attention_layernorm)
        gate = F.silu(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
        return x + F.linear(gate * F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight,
                            mlp.down_proj.bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(x[:, -1:], self._model.model.norm), self._model.lm_head.weight)

    def __call__(self, ids: torch.Tensor, prefix: int,
                 fill: Callable[[int, torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        """Logits of the last token of `ids` (1 x tail), whose first position is `prefix`. Eager off a GPU and on
        the first call for a shape, which then captures the graphs later calls replay."""
        graphs = self._captured.get((prefix, ids.shape[1]))
        if graphs is not None:
            return graphs(ids, fill)
        x = F.embedding(ids, self._model.model.embed_tokens.weight)
        cos, sin = self._rotary(x, prefix)
        keys, values = self._buffers(x, prefix)  # shared by the layers, which run one after another on one stream
        for i in range(len(self._model.model.layers)):
            q = self.before_attention(i, x, cos, sin, keys, values)
            fill(i, keys[:, :, :prefix], values[:, :, :prefix])
            x = self.after_attention(i, x, q, keys, values)
        if ids.is_cuda:
            self._captured[(prefix, ids.shape[1])] = _LayerGraphs(self, ids, prefix)
        return self.logits(x)


class _LayerGraphs:
    """Each layer of a `TailForward` of one (prefix, tail) shape as two CUDA graphs over fixed buffers: up to the
    prefix's attention, and from it on. The layers run one after another on one stream, so they share the buffers:
    the hidden state (each layer's second graph writes its output back into it), the queries, and one prefix + tail
    buffer each of keys and values that every layer's `fill` overwrites in turn. Every tensor a graph reads is
    held here for as long as the graphs: one freed after capture would be read where the allocator put another."""

    def __init__(self, forward: TailForward, ids: torch.Tensor, prefix: int) -> None:
        self._forward, self._prefix = forward, prefix
        self._x = F.embedding(ids, forward._model.model.embed_tokens.weight)
        self._rotary = forward._rotary(self._x, prefix)  # kept: the graphs read it where it lies
        self._keys, self._values = forward._buffers(self._x, prefix)
        layers = range(len(forward._model.model.layers))
        heads = forward._model.config.num_attention_heads
        self._q = torch.empty(1, heads, ids.shape[1], forward._head_dim, dtype=self._x.dtype, device=ids.device)
        pool = torch.cuda.graph_pool_handle()
        self._graphs = [(self._capture(pool, lambda i=i: self._before(i)),
                         self._capture(pool, lambda i=i: self._after(i))) for i in layers]

    def _before(self, i: int) -> None:
        self._q.copy_(self._forward.before_attention(i, self._x, *self._rotary, self._keys, self._values))

    def _after(self, i: int) -> None:
        self._x.copy_(self._forward.after_attention(i, self._x, self._q, self._keys, self._values))

    @staticmethod
    def _capture(pool: Any, launches: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the connector's other threads may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            launches()
        return graph

    def __call__(self, ids: torch.Tensor, fill: Callable[[int, torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
        self._x.copy_(F.embedding(ids, self._forward._model.model.embed_tokens.weight))
        prefix = self._prefix
        for i, (before, after) in enumerate(self._graphs):
            before.replay()
            fill(i, self._keys[:, :, :prefix], self._values[:, :, :prefix])
            after.replay()
        return self._forward.logits(self._x)
