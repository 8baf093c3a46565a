"""The vLLM adapter's worker half reloading a 32k-token prefix layer by layer, against its host-to-device floor.

This is the path a vLLM user with `layer_loads` gets on a CPU hit: the adapter's `WorkerSide` (the class vLLM's
model runner calls) is driven in vLLM's hook order by hand: `handle_preemptions`, `bind`, `start_load_kv`, then per
layer `wait_for_layer_load`, the layer's work and `save_kv_layer`, then `wait_for_save` and the step's reports. The
layer's work reads every byte of that layer's loaded blocks on the compute stream (as attention would) and counts
the blocks whose bits differ from the stored ones, on the GPU, with no host sync. vLLM itself is not needed (the GPU
machines do not have it): the adapter's modules import under `kvfsm.integrations.vllm_stand_in`.

The prefix is shaped as Llama-3-8B's KV (32 layers, 8 KV heads of 128, bf16, 16-token blocks: 4 GiB at 32k tokens),
stored once from random bits into the pinned pool, then reloaded into freshly zeroed, randomly scattered GPU blocks
once per trial. The floor is the prefix's bytes over the host-to-device ceiling of the same run
(`transfer.ceilings`, contiguous pinned copies). A trial is timed by wall clock from the step's first hook until
the GPU is idle, as the other parts time theirs. The race control then runs trials with each layer reading without
its `wait_for_layer_load`: reads that race their segment must show as differing blocks, or the count is blind.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from rich.table import Table

from kvfsm.bench.ttft import _settle_simulated, _sync
from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import ConnectorMetadata, LoadOrder, StoreOrder
from kvfsm.executor.device import Device
from kvfsm.integrations.vllm_stand_in import standing_in

if TYPE_CHECKING:
    from kvfsm.integrations.vllm.worker_side import WorkerSide


class LayerReloadFailed(RuntimeError):
    """The worker's store or reload did not do what its step ordered (not reported, or a load error)."""


@dataclass(frozen=True)
class Prefix:
    """The prefix's KV shape; Llama-3-8B's and 32k tokens unless a test makes it small."""

    tokens: int = 32 * 1024
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_tokens: int = 16
    spare_blocks: int = 64
    """GPU blocks beyond the prefix's, so each trial's destination is a different scattering."""

    @property
    def blocks(self) -> int:
        return self.tokens // self.block_tokens

    @property
    def block_bytes(self) -> int:
        """One block of one layer, keys and values, bf16."""
        return 2 * self.block_tokens * self.kv_heads * self.head_dim * 2

    @property
    def nbytes(self) -> int:
        return self.layers * self.blocks * self.block_bytes


@dataclass(frozen=True)
class Trial:
    ms: float
    differing_blocks: int
    """(layer, block) pairs whose bits, as the layer's work read them, differ from the stored ones."""
    reported_in_step: bool
    """The load is reported done in the output of the step that computed on it."""


class LayerReload:
    """A `WorkerSide` over a paged kv-first cache with the prefix stored in its pool, reloading it per trial."""

    def __init__(self, device: Device, prefix: Prefix = Prefix(), seed: int = 0) -> None:
        from kvfsm.integrations.vllm.worker_side import WorkerSide  # under the stand-in where vLLM is absent

        self.device, self.prefix = device, prefix
        self.num_blocks = prefix.blocks + prefix.spare_blocks
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(prefix.layers)]
        self.caches = {name: torch.empty(2, self.num_blocks, prefix.block_tokens, prefix.kv_heads, prefix.head_dim,
                                         dtype=torch.bfloat16, device=device.tensor_device()) for name in self.names}
        kv_cache_config = SimpleNamespace(num_blocks=self.num_blocks, kv_cache_groups=[SimpleNamespace(
            kv_cache_spec=SimpleNamespace(page_size_bytes=prefix.block_bytes), layer_names=self.names)])
        config = OffloadConfig(cpu_blocks=prefix.blocks, gpu_block_size=prefix.block_tokens, layer_loads=True)
        self.worker: WorkerSide = WorkerSide(config, kv_cache_config, device, 0)  # type: ignore[arg-type]
        self.worker.register_kv_caches(self.caches)
        self._generator = torch.Generator().manual_seed(seed)
        self.slots = tuple(range(prefix.blocks))
        self.expected = self._store()
        self._job = 2  # job 0 and steps 1-2 stored the prefix; trials take the next ids

    def _store(self) -> dict[str, torch.Tensor]:
        """Random bits into the prefix's blocks, stored through the worker in two steps; the stored bits, as int16
        (random bf16 bits include NaNs, which `==` would call unequal to themselves)."""
        for cache in self.caches.values():
            cache.view(torch.int16).random_()
        source = list(range(self.prefix.blocks))
        expected = {name: cache[:, source].view(torch.int16).clone() for name, cache in self.caches.items()}
        self.step(ConnectorMetadata(step=1, stores=(
            StoreOrder(job_id=0, req_id="writer", gpu_blocks=tuple(source), cpu_slots=self.slots),)))
        self.step(ConnectorMetadata(step=2))
        self.worker.kvfsm.wait([0])
        self.worker.poll()
        meta = self.worker.take_worker_meta()
        if meta is None or meta.reports[-1].done != (0,):
            raise LayerReloadFailed("the prefix's store was not reported done")
        return expected

    def step(self, orders: ConnectorMetadata, read: torch.Tensor | None = None,
             wait_layers: bool = True) -> torch.Tensor:
        """One engine step in vLLM's hook order. `read`: the GPU blocks each layer's work reads, in the order of the
        stored blocks; returns the count of (layer, block) pairs read wrong, on the device. `wait_layers=False`
        is the race control: the layers read without waiting for their segments."""
        from kvfsm.integrations.vllm.convert import KvfsmMetadata

        worker = self.worker
        meta = KvfsmMetadata(orders)
        differing = torch.zeros((), dtype=torch.int64, device=self.device.tensor_device())
        worker.handle_preemptions(meta)
        worker.bind(meta)
        worker.start_load_kv()
        for name in self.names:
            if wait_layers:
                worker.wait_for_layer_load(name)
                _settle_simulated(self.device)
            if read is not None:
                bits = self.caches[name][:, read].view(torch.int16)
                differing += (bits != self.expected[name]).any(dim=(0, 2, 3, 4)).sum()
            worker.save_kv_layer(name)
        worker.wait_for_save()
        worker.poll()
        return differing

    def trial(self, wait_layers: bool = True) -> Trial:
        """The stored prefix reloaded into zeroed, scattered blocks and read layer by layer, in one step."""
        self._job += 1
        for cache in self.caches.values():  # a block the load misses reads as zeros, never as a past trial's bits
            cache.zero_()
        destination = torch.randperm(self.num_blocks, generator=self._generator)[:self.prefix.blocks]
        orders = ConnectorMetadata(step=self._job, loads=(LoadOrder(
            job_id=self._job, req_id="reader", gpu_blocks=tuple(destination.tolist()), cpu_slots=self.slots),))
        read = destination.to(self.device.tensor_device())
        _sync(self.device)
        start = time.perf_counter()
        differing = self.step(orders, read, wait_layers)
        _sync(self.device)
        ms = (time.perf_counter() - start) * 1e3
        meta = self.worker.take_worker_meta()
        errors = self.worker.take_load_errors()
        if errors:
            raise LayerReloadFailed(f"trial {self._job}: {len(errors)} blocks reported as load errors")
        return Trial(ms, int(differing), meta is not None and self._job in meta.reports[0].done)

    def close(self) -> None:
        self.worker.shutdown()


def run(device: Device, prefix: Prefix = Prefix(), trials: int = 9, race_trials: int = 20,
        h2d_gbps: float | None = None) -> dict[str, Any]:
    """`trials` timed reloads (after one warm-up) and `race_trials` of the race control. Raises
    `LayerReloadFailed` when a reload reads a wrong byte or is not reported in its own step, or when the race
    control never reads one (then the count could not have failed)."""
    with standing_in():
        reload = LayerReload(device, prefix)
        try:
            reload.trial()
            timed = [reload.trial() for _ in range(trials)]
            raced = [reload.trial(wait_layers=False) for _ in range(race_trials)]
        finally:
            reload.close()
    wrong = [t for t in timed if t.differing_blocks or not t.reported_in_step]
    if wrong:
        raise LayerReloadFailed(f"{len(wrong)} of {trials} reloads read wrong bytes ({wrong[0].differing_blocks} "
                                f"layer blocks) or were not reported in their step")
    caught = sum(t.differing_blocks > 0 for t in raced)
    if race_trials and not caught:
        raise LayerReloadFailed(f"the race control read no wrong byte in {race_trials} trials: the check is blind")
    times = [t.ms for t in timed]
    row: dict[str, Any] = {
        "prompt_tokens": prefix.tokens, "layers": prefix.layers, "prefix_bytes": prefix.nbytes, "trials": trials,
        "median_ms": statistics.median(times), "best_ms": min(times), "trial_ms": times, "differing_blocks": 0,
        "race_control_trials": race_trials, "race_control_caught": caught,
        "race_control_differing_blocks": [t.differing_blocks for t in raced],
    }
    if h2d_gbps is not None:
        row["h2d_gbps"] = h2d_gbps
        row["floor_ms"] = prefix.nbytes / h2d_gbps / 1e6
        row["median_over_floor"] = row["median_ms"] / row["floor_ms"]
        row["best_over_floor"] = row["best_ms"] / row["floor_ms"]
    return row


def table(row: dict[str, Any]) -> Table:
    """The reload's trials against its floor, and what the race control caught."""
    out = Table(title=f"The vLLM adapter's worker half, per-layer reload in vLLM's hook order: "
                      f"{row['prompt_tokens']:,}-token prefix, {row['layers']} layers "
                      f"({row['prefix_bytes'] / 2**30:.2f} GiB), {row['trials']} trials; "
                      f"floor = prefix bytes / H2D ceiling {row['h2d_gbps']:.1f} GB/s")
    for column in ("median ms", "best ms", "floor ms", "median / floor", "best / floor", "blocks differing",
                   "race control: trials caught"):
        out.add_column(column, justify="right")
    out.add_row(f"{row['median_ms']:.1f}", f"{row['best_ms']:.1f}", f"{row['floor_ms']:.1f}",
                f"{row['median_over_floor']:.3f}", f"{row['best_over_floor']:.3f}", str(row["differing_blocks"]),
                f"{row['race_control_caught']} of {row['race_control_trials']}")
    return out
