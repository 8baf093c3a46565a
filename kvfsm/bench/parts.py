"""The bench's parts, each a runner that adds its figures to the one result of the run.

Each runner imports its benchmark lazily: a CPU-only run never imports CUDA-side code, and one part's missing
dependency fails that part alone (`collect` records it and goes on).
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Sequence

from kvfsm.bench.goals import FULL_LAYERS

PARTS = ("scheduler", "disk", "transfer", "connector", "ttft", "vllm-layers", "mooncake", "mla")
GPU_PARTS = ("transfer", "connector", "ttft", "vllm-layers")
CONNECTOR_BLOCK_TOKENS = (16, 32, 64)


def _free_gpu() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _scheduler(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import scheduler, steps
    from kvfsm.bench.policies import ADMISSIONS

    size = {"steps": 6, "requests": 16, "num_slots": 512, "documents": 32} if quick else {}
    step_size = {"steps": 8, "requests": 16, "lifetime": 2, "documents": 8, "repeats": 1} if quick else {}
    result["scheduler"] = {
        "manager": {policy: scheduler.run(policy, **size) for policy in scheduler.POLICIES},  # type: ignore[arg-type]
        "steps": steps.run(**step_size),  # type: ignore[arg-type]
        "steps_by_policy": {policy: steps.run(**step_size, eviction=policy)["us_per_cpu_block_transition"]
                            for policy in scheduler.POLICIES if policy != "lru"},  # type: ignore[arg-type]
        "steps_by_admission": {admission: {policy: _per_block(steps.run(**step_size, eviction=policy,
                                                                        admission=admission))  # type: ignore[arg-type]
                                           for policy in (("lru",) if quick else scheduler.POLICIES)}
                               for admission in ADMISSIONS if admission != "every-block"},  # quick: the plumbing
        "steady": steps.steady_decode(**({"requests": 16, "rounds": 1} if quick else {})),
    }


def _per_block(run: dict[str, Any]) -> dict[str, float | int]:
    """A `steps.run` under an admission setting that skips: its µs per CPU-block transition and per block decision."""
    return {key: run[key] for key in ("us_per_cpu_block_transition", "us_per_block_decision", "blocks_skipped")}


def _disk(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import disk

    result["disk"] = disk.run(total_bytes=(32 << 20) if quick else (1 << 30), reps=1 if quick else 3)


def _transfer(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import transfer
    from kvfsm.executor import CudaDevice

    device = CudaDevice()
    reps = 2 if quick else 9
    result["ceilings"] = transfer.ceilings(device, (1 << 28) if quick else transfer.GIB, reps)
    result["mechanisms"] = {layout: transfer.mechanisms(device, layout, 256 if quick else 1024, result["ceilings"],
                                                        reps) for layout in ("kv-first", "cross-layer")}
    _free_gpu()


def _connector(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import end_to_end
    from kvfsm.executor import CudaDevice

    if "ceilings" not in result:
        _transfer(result, quick)
    device = CudaDevice()
    rows = []
    for layout in ("kv-first", "cross-layer"):
        for tokens in CONNECTOR_BLOCK_TOKENS:
            rows.append(end_to_end.run(device, layout, tokens, result["ceilings"],
                                      moved_bytes=(1 << 28) if quick else (1 << 30), reps=2 if quick else 9))
            _free_gpu()
    result["connector"] = rows
    from kvfsm.bench import token_copy

    result["token_copy"] = token_copy.run(stored_blocks=64 if quick else 512, trials=3 if quick else 15)
    _free_gpu()


def layers_that_fit(free_bytes: int, max_tokens: int) -> int:
    """The most Llama-3-8B layers (up to 32) whose weights, paged and contiguous KV and prefill activations fit."""
    per_layer = 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # bf16 q, o, k, v and the MLP
    per_layer += 4 * max_tokens * 8 * 128 * 2 * 2  # KV: recompute's, its copy, the paged cache, the gathered one
    fixed = 2 * 2 * 128256 * 4096 + 24 * max_tokens * 14336  # embeddings, lm_head; MLP activations of a prefill
    return max(1, min(FULL_LAYERS, (free_bytes - fixed) // per_layer))


def _ttft(result: dict[str, Any], quick: bool) -> None:
    import torch

    from kvfsm.bench import transfer, ttft
    from kvfsm.executor import CudaDevice

    if "ceilings" not in result:  # the reload's floor is the prefix over this run's host-to-device ceiling
        result["ceilings"] = transfer.ceilings(CudaDevice(), (1 << 28) if quick else transfer.GIB, 2 if quick else 5)
    _free_gpu()
    prompts = (2048,) if quick else (2048, 8192, 32768)
    layers = layers_that_fit(torch.cuda.mem_get_info()[0], max(prompts))
    shape = ttft.Shape(num_layers=4 if quick else layers)
    result["ttft"] = ttft.run(CudaDevice(), prompts, shape, reps=1 if quick else 5,
                              h2d_gbps=result["ceilings"]["h2d"])
    if shape.num_layers < FULL_LAYERS:
        result["ttft"]["note"] = (f"{shape.num_layers} of 32 layers fit; times are as measured, not scaled "
                                  "(both paths scale about linearly with layers, so the speedup carries over)")
    _free_gpu()


def _vllm_layers(result: dict[str, Any], quick: bool) -> None:
    from kvfsm.bench import transfer, vllm_layers
    from kvfsm.executor import CudaDevice

    if "ceilings" not in result:  # the reload's floor is the prefix over this run's host-to-device ceiling
        result["ceilings"] = transfer.ceilings(CudaDevice(), (1 << 28) if quick else transfer.GIB, 2 if quick else 5)
    _free_gpu()
    prefix = vllm_layers.Prefix(layers=4) if quick else vllm_layers.Prefix()
    result["vllm_layers"] = vllm_layers.run(CudaDevice(), prefix, trials=2 if quick else 9,
                                            race_trials=3 if quick else 20, h2d_gbps=result["ceilings"]["h2d"])
    _free_gpu()


def _mooncake(result: dict[str, Any], quick: bool, hash_threads: Sequence[int | None] = (None,),
              blocks: int | None = None) -> None:
    """Both placements, each with every count of MAC threads in `hash_threads` (None: the client's default), calls
    of `blocks` blocks (None: the bench's default)."""
    from kvfsm.bench import mooncake

    result["mooncake"] = [mooncake.run(quick, segment, threads, blocks) for segment in ("segment host", "own")
                          for threads in hash_threads]


def _mla(result: dict[str, Any], quick: bool) -> None:
    """On two GPUs the figures; without CUDA the byte counts on SimDevices (a second); with one GPU, why not."""
    import torch

    from kvfsm.bench import mla

    if not torch.cuda.is_available():
        result["mla"] = {**mla.run(mla.PLUMBING, cuda=False), "note": "SimDevices: byte counts, no bandwidth"}
        return
    try:
        result["mla"] = mla.run(mla.QUICK if quick else mla.MlaShape())
    except mla.TwoDevicesNeeded as refused:
        result["mla"] = {"note": f"not run: {refused}"}


Runner = Callable[[dict[str, Any], bool], None]
"""A part's runner: adds its figures to the result, given whether the run is `--quick`."""
RUNNERS: dict[str, Runner] = {
    "scheduler": _scheduler, "disk": _disk, "transfer": _transfer, "connector": _connector, "ttft": _ttft,
    "vllm-layers": _vllm_layers, "mooncake": _mooncake, "mla": _mla,
}
