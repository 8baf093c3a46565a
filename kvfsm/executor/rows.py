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


def _rows(t: torch.Tensor) -> tuple[int, int, int]:
    """(address, pitch, width) of a 2-D uint8 view whose rows are contiguous."""
    if t.dim() != 2 or t.dtype != torch.uint8 or (t.shape[0] > 1 and t.stride(1) != 1):
        raise RowCopyError(f"expected uint8 rows with contiguous bytes, got {t.dtype} {tuple(t.shape)} {t.stride()}")
    pitch = t.stride(0) if t.shape[0] > 1 else t.shape[1]
    return t.data_ptr(), pitch, t.shape[1]


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src`'s rows into `dst`'s (both 2-D uint8, same shape) on the current stream, without blocking."""
    if dst.shape != src.shape:
        raise RowCopyError(f"row copy between shapes {tuple(src.shape)} and {tuple(dst.shape)}")
    if dst.device.type != "cuda" and src.device.type != "cuda":
        dst.copy_(src)
        return
    copy = _Memcpy2D()
    copy.srcMemoryType, copy.dstMemoryType = (_DEVICE if t.is_cuda else _HOST for t in (src, dst))
    src_ptr, copy.srcPitch, width = _rows(src)
    dst_ptr, copy.dstPitch, _ = _rows(dst)
    if src.is_cuda:
        copy.srcDevice = src_ptr
    else:
        copy.srcHost = src_ptr
    if dst.is_cuda:
        copy.dstDevice = dst_ptr
    else:
        copy.dstHost = dst_ptr
    copy.WidthInBytes, copy.Height = width, dst.shape[0]
    stream = torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).cuda_stream
    code = _driver().cuMemcpy2DAsync_v2(ctypes.byref(copy), ctypes.c_void_p(stream))
    if code != 0:
        raise RowCopyError(f"cuMemcpy2DAsync of {dst.shape[0]} rows x {width} bytes failed with CUresult {code}")
