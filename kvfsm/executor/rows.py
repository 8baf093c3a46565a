"""Equal-sized rows at a fixed pitch on each side, copied between host and device as one DMA.

A layer's share of a CPU block is one contiguous range, but the CPU block holds every layer of its GPU block, so
one layer of a run of consecutive CPU blocks is a column of equal rows a block apart. Moving a layer one row at a
time costs a copy call per block (tens of thousands for a long prompt); `cuMemcpy2DAsync` moves the whole column
in one call at copy-engine speed. torch has no strided host-device copy (it makes the host side contiguous first,
on the CPU), so on CUDA this calls the driver directly; on the CPU it is an ordinary strided `copy_`.
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
        self._copy = _Memcpy2D()
        self._ref = ctypes.byref(self._copy)
        self._issue = _driver().cuMemcpy2DAsync_v2

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


class RowCopies:
    """2-D copies between byte ranges of flat uint8 buffers on the current stream: straight to the driver where
    either side is on a GPU (`RawRows`), an ordinary strided `copy_` on the CPU (the simulator's caches)."""

    def __init__(self, device: torch.device) -> None:
        self._raw = RawRows(torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, dst_offset: int, dst_pitch: int, src: torch.Tensor, src_offset: int,
             src_pitch: int, width: int, height: int) -> None:
        """Row i (of `height`) is `width` bytes at `src_offset + i * src_pitch` of `src`, copied to
        `dst_offset + i * dst_pitch` of `dst`; offsets count bytes from each buffer's first element."""
        if self._raw is None:
            rows = (height, width)
            dst.as_strided(rows, (dst_pitch, 1), dst.storage_offset() + dst_offset).copy_(
                src.as_strided(rows, (src_pitch, 1), src.storage_offset() + src_offset))
            return
        self._raw.copy(dst.data_ptr() + dst_offset, dst_pitch, dst.is_cuda, src.data_ptr() + src_offset, src_pitch,
                       src.is_cuda, width, height)
