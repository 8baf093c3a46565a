"""Equal-sized rows at a fixed pitch on each side, copied between host and device as one DMA.

A layer's share of a CPU block is one contiguous range, but the CPU block holds every layer of its GPU block, so
one layer of a run of consecutive CPU blocks is a column of equal rows a block apart. Moving a layer one row at a
time costs a copy call per block (tens of thousands for a long prompt); `cuMemcpy2DAsync` moves the whole column
in one call at copy-engine speed. torch has no strided host-device copy (it makes the host side contiguous first,
on the CPU), so on CUDA this calls the driver directly; on the CPU it is an ordinary strided `copy_`.

Many one-row copies (a DMA-only job: one per run of scattered blocks, hundreds per GiB) go to the driver as one
`cuMemcpyBatchAsync` where the driver has it (CUDA 13): one call instead of one per copy, so a step's submission
no longer outlasts its copies when both directions move at once.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch


class RowCopyError(RuntimeError):
    """The CUDA driver refused a 2-D copy."""


class _Memcpy2D(ctypes.Structure):
    """`CUDA_MEMCPY2D` of the driver API."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


_HOST, _DEVICE = 1, 2  # CUmemorytype


class _MemLocation(ctypes.Structure):
    """`CUmemLocation`."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """`CUmemcpyAttributes` of the driver's batched copies."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


FIRST_BATCH, LARGEST_BATCH = 4, 128
"""Held copies go to the driver 4 at first, then twice as many each time up to 128: the copy engine starts after
a few copies were planned rather than after the whole job (1.5 ms of host time for a 1 GiB scattered store)."""
_ACCESS_IN_STREAM_ORDER = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source is read when the stream gets there
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # CUmemLocationType
_ON_COPY_ENGINES = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: leave the SMs to compute


@cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


class RawRows:
    """2-D copies between addresses already known, issued straight to the driver on one CUDA stream.

    A staged copy issues one of these per run of consecutive blocks (hundreds per GiB for a scattered cross-layer
    cache) and a per-layer load one per layer and host run. Building tensor views and a driver struct for each
    cost tens of microseconds of host time apiece, which made submission, not the copy engines, the bound
    (measured on the H100: 16 ms of host time to submit a 1 GiB cross-layer store that copies in 19.5 ms). Here
    one struct is reused and only addresses and sizes change, so a copy costs about one ctypes call."""

    def __init__(self, stream: int) -> None:
        self._stream = ctypes.c_void_p(stream)
        self._legacy_default = stream == 0
        self._copy = _Memcpy2D()
        self._ref = ctypes.byref(self._copy)
        self._issue = _driver().cuMemcpy2DAsync_v2
        self.batch = _batch_issue()
        """The driver's `cuMemcpyBatchAsync` (CUDA 13's signature), or None where it lacks one."""

    @property
    def batches(self) -> bool:
        """Whether `copy_many` can run here: the driver has batched copies, and the stream is not the legacy
        default stream, which they refuse (CUDA_ERROR_INVALID_VALUE)."""
        return self.batch is not None and not self._legacy_default

    def copy(self, dst: int, dst_pitch: int, dst_on_device: bool, src: int, src_pitch: int, src_on_device: bool,
             width: int, height: int) -> None:
        """Copy `height` rows of `width` bytes from `src` (rows `src_pitch` apart) to `dst` (`dst_pitch` apart)."""
        c = self._copy
        c.srcMemoryType, c.dstMemoryType = (_DEVICE if src_on_device else _HOST), (_DEVICE if dst_on_device else _HOST)
        c.srcDevice, c.srcHost = (src, None) if src_on_device else (0, src)
        c.dstDevice, c.dstHost = (dst, None) if dst_on_device else (0, dst)
        c.srcPitch, c.dstPitch, c.WidthInBytes, c.Height = src_pitch, dst_pitch, width, height
        code = self._issue(self._ref, self._stream)
        if code != 0:
            raise RowCopyError(f"cuMemcpy2DAsync of {height} rows x {width} bytes failed with CUresult {code}")

    def copy_many(self, dsts: list[int], srcs: list[int], sizes: list[int], to_device: bool, device: int) -> None:
        """Contiguous copies `sizes[i]` bytes from `srcs[i]` to `dsts[i]`, all host-to-device (`to_device`) or all
        device-to-host, as one batch in stream order (copies inside a batch may run in any order: never pass two
        that overlap). Needs `batches`."""
        n = len(sizes)
        gpu, host = _MemLocation(_LOCATION_DEVICE, device), _MemLocation(_LOCATION_HOST, 0)
        attributes = _MemcpyAttributes(_ACCESS_IN_STREAM_ORDER, host if to_device else gpu,
                                       gpu if to_device else host, _ON_COPY_ENGINES)
        words = ctypes.c_uint64 * n
        code = self.batch(words(*dsts), words(*srcs), (ctypes.c_size_t * n)(*sizes), n, ctypes.byref(attributes),
                          ctypes.byref(ctypes.c_size_t(0)), 1, self._stream)
        if code != 0:
            raise RowCopyError(f"cuMemcpyBatchAsync of {n} copies ({sum(sizes)} bytes) failed with CUresult {code}")


@cache
def _batch_issue() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """`cuMemcpyBatchAsync_v2` (CUDA 13: no failure index), typed; None on a driver without it."""
    try:
        issue = _driver().cuMemcpyBatchAsync_v2
    except AttributeError:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    issue.argtypes = [pointer, pointer, pointer, size, pointer, pointer, size, pointer]
    issue.restype = ctypes.c_int
    return issue


class RowCopies:
    """2-D copies between byte ranges of flat uint8 buffers on the current stream: straight to the driver where
    either side is on a GPU (`RawRows`), an ordinary strided `copy_` on the CPU (the simulator's caches).

    `batched=True` (use it as a context manager) holds one-row copies between host and device and issues them as
    one driver batch when the context ends or a copy of another kind comes; elsewhere every copy is issued at once.
    """

    def __init__(self, device: torch.device, batched: bool = False) -> None:
        self._raw: RawRows | None = None
        self._device = 0
        if device.type == "cuda":
            self._raw = RawRows(torch.cuda.current_stream(device).cuda_stream)
            self._device = torch.cuda.current_device() if device.index is None else device.index
        self._held: tuple[list[int], list[int], list[int]] | None = \
            ([], [], []) if batched and self._raw is not None and self._raw.batches else None
        self._to_device = False
        self._batch = FIRST_BATCH

    def __enter__(self) -> RowCopies:
        return self

    def __exit__(self, *_: object) -> None:
        self.flush()

    def copy(self, dst: torch.Tensor, dst_offset: int, dst_pitch: int, src: torch.Tensor, src_offset: int,
             src_pitch: int, width: int, height: int) -> None:
        """Row i (of `height`) is `width` bytes at `src_offset + i * src_pitch` of `src`, copied to
        `dst_offset + i * dst_pitch` of `dst`; offsets count bytes from each buffer's first element."""
        if self._raw is None:
            rows = (height, width)
            dst.as_strided(rows, (dst_pitch, 1), dst.storage_offset() + dst_offset).copy_(
                src.as_strided(rows, (src_pitch, 1), src.storage_offset() + src_offset))
            return
        if self._held is not None and height == 1 and dst.is_cuda != src.is_cuda:
            if self._held[2] and dst.is_cuda != self._to_device:
                self.flush()
            self._to_device = dst.is_cuda
            held = self._held
            held[0].append(dst.data_ptr() + dst_offset)
            held[1].append(src.data_ptr() + src_offset)
            held[2].append(width)
            if len(held[2]) >= self._batch:  # the first copies go out early, so the copy engine starts
                self.flush()
                self._batch = min(2 * self._batch, LARGEST_BATCH)
            return
        self.flush()
        self._raw.copy(dst.data_ptr() + dst_offset, dst_pitch, dst.is_cuda, src.data_ptr() + src_offset, src_pitch,
                       src.is_cuda, width, height)

    def flush(self) -> None:
        """Issue the one-row copies held so far as one batch. They are let go whether or not the driver took
        them: a refused batch raised once, failing its job, and still held it would go to the driver again as
        the context ends, raising a second error over the first or, if taken then, copying for a failed job."""
        held = self._held
        if held is not None and held[2]:
            try:
                self._raw.copy_many(*held, self._to_device, self._device)  # type: ignore[union-attr]
            finally:
                for column in held:  # emptied in place: the driver got copies of them
                    column.clear()
