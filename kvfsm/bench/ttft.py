"""Time to first token on a CPU prefix hit: recomputing the prompt vs kvfsm reloading its KV layer by layer.

The model is a real Llama-architecture `transformers.LlamaForCausalLM` with Llama-3-8B's shape and random weights
(built from its config on the device, nothing downloaded), with the attention an engine runs (`kvfsm.bench.llama`).
Recompute is one prefill of the whole prompt. Reload is what a user sees on a CPU hit with an engine that calls the
per-layer hooks: the connector loads the prompt's stored blocks (all but the last, which the engine always computes
for its logits) from the pinned pool into scattered blocks of a paged kv-first cache, one segment per layer, and the
model prefills the last block in the same step, each layer waiting (on the GPU) for that layer's segment only.

The KV that is stored is the KV the recompute produced, and after the reload every byte of the paged blocks it loaded
is compared with that KV (`blocks_differing`): one block that differs fails the run, so the bytes really went
GPU -> CPU -> GPU. The logits' distance from the recompute's is reported, not judged: bf16 prefill in one pass and
prefix-then-tail differ by rounding (~5e-2 relative), which at 8k tokens is as far as one zeroed 16-token block moves
them (~0.2), so no tolerance on logits can tell a reload that lost a block from an honest one. `transformers` attends
over a contiguous cache, not a paged one, so each layer also gathers its loaded blocks into one after its wait: a
paged-attention engine skips that step.
The physical floor of a reload is the prefix's bytes over the host-to-device ceiling measured in the same run.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from kvfsm.bench.connector import Prompt
from kvfsm.bench.llama import ATTENTION, TailForward, register_attention
from kvfsm.config import OffloadConfig
from kvfsm.connector import Connector
from kvfsm.connector.metadata import ConnectorOutput, ScheduledRequest, SchedulerOutput
from kvfsm.executor.device import Device
from kvfsm.executor.layouts import allocate_kv_caches

LLAMA_3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "vocab_size": 128256, "rope_theta": 500000.0}


class ReloadMismatch(RuntimeError):
    """The reload did not give back the stored prefix: a block's bytes differ, or the load was not in its step."""


def blocks_differing(stored: list[torch.Tensor], reloaded: Iterable[torch.Tensor]) -> int:
    """The prefix blocks whose bits differ between what was stored and what the reload put in the paged cache in
    any layer; per layer both are (K and V, blocks, block tokens, heads, dim), `stored` on any device. Compared as
    bits: bf16 `==` would call a NaN unequal to itself and -0.0 equal to 0.0."""
    differing: torch.Tensor | None = None
    for before, after in zip(stored, reloaded, strict=True):
        if before.shape != after.shape:
            raise ReloadMismatch(f"stored KV shaped {tuple(before.shape)}, reloaded {tuple(after.shape)}")
        layer = (before.to(after.device).view(torch.int16) != after.view(torch.int16)).any(dim=(0, 2, 3, 4))
        differing = layer if differing is None else differing | layer
    return 0 if differing is None else int(differing.sum())


@dataclass(frozen=True)
class Shape:
    """The model's size; `num_layers` below the full 32 only where the full model does not fit."""

    num_layers: int = 32
    hidden_size: int = LLAMA_3_8B["hidden_size"]
    intermediate_size: int = LLAMA_3_8B["intermediate_size"]
    num_attention_heads: int = LLAMA_3_8B["num_attention_heads"]
    num_key_value_heads: int = LLAMA_3_8B["num_key_value_heads"]
    head_dim: int = LLAMA_3_8B["head_dim"]
    vocab_size: int = LLAMA_3_8B["vocab_size"]


def build_model(shape: Shape, max_tokens: int, device: torch.device) -> Any:
    """A randomly initialised Llama in bf16, built directly on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    register_attention()
    config = LlamaConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                         num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_attention_heads,
                         num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
                         vocab_size=shape.vocab_size, max_position_embeddings=max_tokens,
                         attn_implementation=ATTENTION)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def _sync(device: Device) -> None:
    if device.kind == "cuda":
        torch.cuda.synchronize()


def _settle_simulated(device: Device) -> None:
    """On the simulator the host's reads happen now, so its streams must have run first; on CUDA the compute
    stream's wait does that."""
    run = getattr(device, "run_until_idle", None)
    if run is not None:
        run()


class PrefixReload:
    """A connector over a paged kv-first cache of the model's shape, big enough for the longest prompt."""

    def __init__(self, device: Device, shape: Shape, max_tokens: int, block_tokens: int = 16, seed: int = 0) -> None:
        self.device = device
        self.block_tokens = block_tokens
        self.num_blocks = max_tokens // block_tokens + 1
        tensors, _ = allocate_kv_caches("kv-first", shape.num_layers, self.num_blocks, block_tokens,
                                        shape.num_key_value_heads, shape.head_dim, torch.bfloat16,
                                        device.tensor_device())
        self.names = list(tensors)
        self.layers = list(tensors.values())
        self.connector = Connector(OffloadConfig(cpu_blocks=self.num_blocks, gpu_block_size=block_tokens,
                                                 layer_loads=True), device)
        self.connector.register_kv_caches(tensors, "kv-first")
        self._rng = random.Random(seed)
        self._serial = 0
        self.stored: list[torch.Tensor] = []
        """The last stored prefix's KV per layer (on the host: the GPU holds the model), as `reloaded_kv` gives it."""
        self.loaded_blocks: list[int] = []
        """The GPU blocks the last reload loaded into, in the prefix's order."""

    def _request(self, hashes: tuple[int, ...], tokens: int) -> Prompt:
        self._serial += 1
        return Prompt(f"ttft{self._serial}", hashes, tokens)

    def _scattered(self, n: int) -> list[int]:
        return self._rng.sample(range(self.num_blocks), n)

    def _step(self, scheduled: tuple[ScheduledRequest, ...] = ()) -> set[str]:
        """One engine step with no compute of its own; waits for every job; returns the requests that loaded."""
        connector, worker = self.connector, self.connector.worker
        worker.bind_connector_metadata(connector.build_connector_meta(SchedulerOutput(scheduled=scheduled)))
        worker.handle_preemptions()
        worker.start_load_kv()
        worker.wait_for_save()
        worker.wait(list(worker.jobs))
        return connector.update_connector_output(ConnectorOutput(workers=(worker.get_finished(),))).loaded

    def store(self, past: Any, hashes: tuple[int, ...], tokens: int) -> None:
        """Page the prompt's KV (a transformers cache) into scattered blocks and store them through the connector."""
        n = len(hashes)
        blocks = self._scattered(n + 1)
        index = torch.tensor(blocks[:n], device=self.device.tensor_device())
        self.stored = []
        for layer, cache in zip(past.layers, self.layers):
            for plane, values in enumerate((layer.keys, layer.values)):
                paged = values[0, :, :n * self.block_tokens].transpose(0, 1)
                cache[plane].index_copy_(0, index, paged.reshape(n, self.block_tokens, *paged.shape[1:]))
            self.stored.append(cache.index_select(1, index).cpu())
        prompt = self._request(hashes, tokens)
        if self.connector.get_num_new_matched_tokens(prompt, 0) != (0, False):
            raise ReloadMismatch("a fresh prompt hit the pool")
        self.connector.update_state_after_alloc(prompt, blocks, 0)
        self._step((ScheduledRequest(req_id=prompt.request_id, block_ids=tuple(blocks), num_computed_tokens=tokens),))
        self.connector.request_finished(prompt.request_id)
        self._step()
        for cache in self.layers:  # whatever a load fails to write shows in the logits
            cache.zero_()

    def reload(self, tail: TailForward, ids: torch.Tensor, hashes: tuple[int, ...], tokens: int) -> tuple[Prompt, Any]:
        """A returning request's CPU hit, computed in the step that loads it: the connector orders the load, the
        worker sends it out one segment per layer, and the model prefills the tail (`TailForward`, the model's
        weights launched as an engine launches them) with each layer waiting for its own segment before it attends,
        then gathering it into the contiguous buffer it attends over. Returns the request (for `finish`) and the
        logits, still being computed."""
        n = len(hashes)
        prompt = self._request(hashes, tokens)
        blocks = self._scattered(n + 1)
        self.loaded_blocks = blocks[:n]
        connector, worker = self.connector, self.connector.worker
        if connector.get_num_new_matched_tokens(prompt, 0) != (n * self.block_tokens, False):
            raise ReloadMismatch("the stored prefix is not all in the pool (or its load would not be computed now)")
        connector.update_state_after_alloc(prompt, blocks, n * self.block_tokens)
        scheduled = ScheduledRequest(req_id=prompt.request_id, block_ids=tuple(blocks), num_computed_tokens=tokens)
        worker.bind_connector_metadata(connector.build_connector_meta(SchedulerOutput(scheduled=(scheduled,))))
        worker.handle_preemptions()
        worker.start_load_kv()
        index = torch.tensor(blocks[:n], device=self.device.tensor_device())

        def fill(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            worker.wait_for_layer_load(self.names[layer])
            _settle_simulated(self.device)
            for plane, out in ((0, keys), (1, values)):
                gathered = self.layers[layer][plane].index_select(0, index)  # (blocks, block tokens, heads, dim)
                out[0].view(out.shape[1], n, self.block_tokens, -1).copy_(gathered.permute(2, 0, 1, 3))

        logits = tail(ids[:, n * self.block_tokens:], n * self.block_tokens, fill)
        worker.wait_for_save()
        return prompt, logits

    def finish(self, prompt: Prompt) -> None:
        """After a reload: its load is reported, then the request ends."""
        worker = self.connector.worker
        worker.wait(list(worker.jobs))
        loaded = self.connector.update_connector_output(ConnectorOutput(workers=(worker.get_finished(),))).loaded
        if loaded != {prompt.request_id}:
            raise ReloadMismatch("the load did not finish in its step")
        self.connector.request_finished(prompt.request_id)

    def reloaded_kv(self) -> Iterator[torch.Tensor]:
        """Per layer, the paged blocks the last reload loaded (its tail is computed outside the paged cache), one
        layer at a time: the GPU has room for one more layer's prefix, not for all of them."""
        index = torch.tensor(self.loaded_blocks, device=self.device.tensor_device())
        return (cache.index_select(1, index) for cache in self.layers)

    def close(self) -> None:
        self.connector.worker.shutdown()


def _median_ms(fn: Callable[[], Any], device: Device, reps: int) -> tuple[float, Any]:
    """Median wall milliseconds of `fn` (after a warm-up), and its last result."""
    times, result = [], fn()
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b).norm() / a.norm())


@torch.inference_mode()
def run(device: Device, prompt_tokens: tuple[int, ...] = (2048, 8192, 32768), shape: Shape = Shape(),
        reps: int = 3, block_tokens: int = 16, seed: int = 0, h2d_gbps: float | None = None) -> dict[str, Any]:
    """Recompute and reload milliseconds for each prompt length, the speedup of reload, and reload against its
    physical floor (prefix bytes over `h2d_gbps`, the host-to-device ceiling of the same run) where given."""
    torch.manual_seed(seed)
    model = build_model(shape, max(prompt_tokens), device.tensor_device())
    reload = PrefixReload(device, shape, max(prompt_tokens), block_tokens, seed)
    tail = TailForward(model)  # one for the run: it keeps the graphs it captures for each prompt length
    rows = []
    try:
        for tokens in prompt_tokens:
            ids = torch.randint(0, shape.vocab_size, (1, tokens), device=device.tensor_device())
            recompute_ms, full = _median_ms(lambda: model(ids, use_cache=True, logits_to_keep=1), device, reps)
            n = (tokens - 1) // block_tokens  # the last token is always computed, for its logits
            hashes = tuple(tokens << 32 | i for i in range(n))
            reload.store(full.past_key_values, hashes, tokens)
            recompute_logits = full.logits
            del full

            def reloaded() -> tuple[torch.Tensor, float]:
                _sync(device)
                start = time.perf_counter()
                prompt, logits = reload.reload(tail, ids, hashes, tokens)
                _sync(device)
                elapsed = (time.perf_counter() - start) * 1e3
                reload.finish(prompt)
                return logits, elapsed

            samples = [reloaded() for _ in range(reps + 1)][1:]
            differing = blocks_differing(reload.stored, reload.reloaded_kv())
            if differing:
                raise ReloadMismatch(f"{tokens} tokens: {differing} of {n} reloaded blocks differ from the stored KV")
            error = _relative_error(recompute_logits, samples[-1][0])
            reload_ms = statistics.median(s[1] for s in samples)
            prefix_bytes = n * reload.connector.scheduler.gpu_block_bytes
            row = {"prompt_tokens": tokens, "recompute_ms": recompute_ms, "reload_ms": reload_ms,
                   "tail_tokens": tokens - n * block_tokens, "loaded_blocks": n, "prefix_bytes": prefix_bytes,
                   "speedup": recompute_ms / reload_ms, "blocks_differing": differing,
                   "logits_relative_error": error}
            if h2d_gbps is not None:
                row["floor_ms"] = prefix_bytes / h2d_gbps / 1e6
                row["reload_over_floor"] = reload_ms / row["floor_ms"]
            rows.append(row)
            del samples
    finally:
        reload.close()
    return {"num_layers": shape.num_layers, "model": "Llama-3-8B shape, random bf16 weights (transformers)",
            "reps": reps, "h2d_gbps": h2d_gbps, "rows": rows}
