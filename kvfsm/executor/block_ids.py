"""GPU block ids for the executor's kernels, read by the GPU straight from pinned host memory.

A gathering store needs its blocks' ids on the GPU, and so do a scatter and a poisoning fill. Copied there on
the job's stream (a `cudaMemcpyAsync` from pinned memory), a store's ids went to the host-to-device copy engine
and waited behind the loads already queued there, and the store's device-to-host copies, in stream order behind
them, waited as well. On an H100 (kv-first caches, stores and loads at once over eight back-to-back steps), the
device-to-host engine stood idle for ~19 ms, one load job's length, before most store jobs: 0.70-0.89 of the
both-ways ceiling, and 0.92-1.03 with the ids read as below.

Pinned host memory is mapped into the GPU's address space under unified addressing, so one small kernel on the
job's stream reads the ids from there into device memory, and no copy engine is involved.

That kernel reads the host ids when its stream gets to it, which can be long after the call: a store waits for
the forward pass that writes its blocks. Each host copy is kept, with an event recorded after the kernel, until
the event has completed. Otherwise torch's pinned allocator could hand the memory out again, and a later job's
ids could overwrite it before it was read: the wrong blocks gathered, silently.

torch places a mapped host tensor on the device whose context the pinned memory was allocated under, and its pinned
allocator reuses memory whichever device asks. With several GPUs in one process (tensor-parallel ranks on threads,
`python -m kvfsm.bench mla`), ids for one device may come in memory another device's context allocated: a kernel
on this device cannot take that tensor (torch refuses tensors of two devices), so those ids are copied on the
job's stream as before this module (a copy engine again, for a few bytes). One process per GPU, as vLLM runs,
always reads them in place.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch


class MappedHost:
    """Pinned int64 host memory described to torch as GPU memory (`__cuda_array_interface__`, version 3), so a
    kernel can read it over the bus. torch places it on the device the pinned memory belongs to."""

    def __init__(self, host: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i8", "data": (host.data_ptr(), False),
                                         "version": 3}


class BlockIds:
    """Uploads block ids for kernels on the current stream of the caches' device (plain int64 tensors off a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._kept: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        """Host ids, oldest first, with the event after the kernel that reads them."""

    def __call__(self, ids: Sequence[int]) -> torch.Tensor:
        """`ids` as an int64 tensor on the device, filled by the time the current stream gets past this call."""
        if self._device.type != "cuda":
            return torch.tensor(ids, dtype=torch.int64)
        out = torch.empty(len(ids), dtype=torch.int64, device=self._device)
        if not ids:
            return out
        while self._kept and self._kept[0][0].query():
            self._kept.popleft()
        host = torch.tensor(ids, dtype=torch.int64, pin_memory=True)
        mapped = torch.as_tensor(MappedHost(host))
        if mapped.device == out.device:
            torch.add(mapped, 0, out=out)  # an elementwise kernel: `copy_` would be a memcpy on a copy engine again
        else:  # pinned under another device's context (several GPUs in this process)
            out.copy_(host, non_blocking=True)
        read = torch.cuda.Event()
        read.record()
        self._kept.append((read, host))
        return out

    @property
    def kept(self) -> int:
        """Host copies of ids still kept for a kernel that may not have read them yet."""
        return len(self._kept)
