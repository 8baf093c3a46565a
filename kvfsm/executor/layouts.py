"""KV-cache layouts reduced to one shape the transfer code understands.

Engines lay KV caches out in several ways (K and V planes first, blocks first, MLA's single latent, or all layers
of a block side by side). Whatever the layout, one GPU block of one tensor is a few equal contiguous byte pieces:
two (K, V) for "kv-first", one for the others. Registration turns every tensor into such a `Plane`, checks
everything a wrong copy could come from (shape, block count, contiguity, device, dtype), and fixes where each piece
lives inside a CPU block, so mechanisms only ever move bytes between planes and host ranges.

A CPU block is block-major: all pieces of one GPU block (group by group, layer by layer, K before V) are
contiguous, which makes one GPU block one contiguous host range and a whole staging chunk one DMA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

LAYOUTS = ("kv-first", "blocks-first", "mla", "cross-layer")
SUPPORTED_DTYPES = frozenset({
    torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8,
})
SUPPORTED_DEVICE_TYPES = frozenset({"cpu", "cuda"})


class LayoutError(ValueError):
    """KV caches that cannot be registered as given."""


@dataclass(frozen=True)
class Plane:
    """One registered tensor as `pieces` x `num_blocks` contiguous byte rows of `piece_bytes` each."""

    name: str
    rows: torch.Tensor  # uint8, shape (pieces, num_blocks, piece_bytes)
    offset: int  # where this tensor's pieces start inside one GPU block's bytes on the host

    @property
    def pieces(self) -> int:
        return self.rows.shape[0]

    @property
    def piece_bytes(self) -> int:
        return self.rows.shape[2]

    @property
    def block_bytes(self) -> int:
        return self.pieces * self.piece_bytes


@dataclass(frozen=True)
class KVCaches:
    """Every plane of every group; all groups share one block-id space."""

    planes: tuple[Plane, ...]
    layouts: Mapping[str, str]  # group -> layout
    num_blocks: int
    gpu_block_bytes: int
    device: torch.device
    block_tokens: int  # tokens one GPU block pages, read from the shape (every tensor agrees)

    @property
    def block_contiguous(self) -> bool:
        """Whether each block is one contiguous range in every tensor (so runs of blocks coalesce)."""
        return all(plane.pieces == 1 for plane in self.planes)


def _block_axis(layout: str, shape: tuple[int, ...]) -> int | None:
    """Which axis indexes blocks, or None when the shape does not fit the layout."""
    if layout == "kv-first":
        return 1 if len(shape) == 5 and shape[0] == 2 else None
    if layout == "blocks-first":
        return 0 if len(shape) == 5 and shape[1] == 2 else None
    if layout == "mla":
        return 0 if len(shape) == 3 else None
    # cross-layer: (blocks, layers, 2, block_size, heads, dim) or MLA's (blocks, layers, block_size, dim)
    return 0 if len(shape) == 6 and shape[2] == 2 or len(shape) == 4 else None


def _token_axis(layout: str, shape: tuple[int, ...]) -> int:
    """Which axis counts a block's tokens, for a shape `_block_axis` accepted."""
    if layout == "mla":
        return 1
    if layout == "cross-layer":
        return 3 if len(shape) == 6 else 2
    return 2


def _check_tensor(name: str, tensor: torch.Tensor, layout: str) -> int:
    """The tensor's block count, after refusing everything the transfer code cannot copy exactly."""
    if not isinstance(tensor, torch.Tensor):
        raise LayoutError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type not in SUPPORTED_DEVICE_TYPES:
        raise LayoutError(f"{name}: tensors on {tensor.device.type} are not supported")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise LayoutError(f"{name}: dtype {tensor.dtype} is not supported")
    if not tensor.is_contiguous():
        raise LayoutError(f"{name}: the tensor must be contiguous (strides {tensor.stride()})")
    axis = _block_axis(layout, tuple(tensor.shape))
    if axis is None:
        raise LayoutError(f"{name}: shape {tuple(tensor.shape)} does not fit layout {layout!r}")
    if tensor.numel() == 0:
        raise LayoutError(f"{name}: the tensor is empty")
    return tensor.shape[axis]


def _rows(tensor: torch.Tensor, layout: str, num_blocks: int) -> torch.Tensor:
    raw = tensor.view(torch.uint8).reshape(-1)
    if layout == "kv-first":
        return raw.view(2, num_blocks, -1)
    return raw.view(1, num_blocks, -1)


def _groups_of(names: list[str], groups: Mapping[str, list[str]] | None) -> dict[str, list[str]]:
    if groups is None:
        return {"default": names}
    seen: dict[str, str] = {}
    for group, members in groups.items():
        if not members:
            raise LayoutError(f"group {group!r} has no layers")
        for name in members:
            if name not in names:
                raise LayoutError(f"group {group!r} names {name!r}, which is not among the KV caches")
            if name in seen:
                raise LayoutError(f"{name!r} is in both group {seen[name]!r} and group {group!r}")
            seen[name] = group
    missing = [n for n in names if n not in seen]
    if missing:
        raise LayoutError(f"KV caches in no group: {missing}")
    return {group: list(members) for group, members in groups.items()}


def register_kv_caches(kv_caches: Mapping[str, torch.Tensor], layout: str | Mapping[str, str],
                       groups: Mapping[str, list[str]] | None = None) -> KVCaches:
    """Check and describe `kv_caches` (name -> tensor); `layout` is one layout or one per group."""
    if not kv_caches:
        raise LayoutError("no KV caches to register")
    by_group = _groups_of(list(kv_caches), groups)
    layouts = {g: layout for g in by_group} if isinstance(layout, str) else dict(layout)
    for group in by_group:
        if layouts.get(group) not in LAYOUTS:
            raise LayoutError(f"group {group!r}: layout {layouts.get(group)!r} is not one of {LAYOUTS}")
    devices = {t.device for t in kv_caches.values() if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise LayoutError(f"KV caches are spread over several devices: {sorted(map(str, devices))}")
    planes: list[Plane] = []
    num_blocks: int | None = None
    block_tokens: int | None = None
    offset = 0
    for group, members in by_group.items():
        for name in members:
            tensor = kv_caches[name]
            blocks = _check_tensor(name, tensor, layouts[group])
            tokens = tensor.shape[_token_axis(layouts[group], tuple(tensor.shape))]
            if num_blocks is None:
                num_blocks, block_tokens = blocks, tokens
            elif blocks != num_blocks:
                raise LayoutError(f"{name}: {blocks} blocks, but other KV caches have {num_blocks}")
            elif tokens != block_tokens:
                raise LayoutError(f"{name}: {tokens} tokens per block, but other KV caches have {block_tokens}")
            plane = Plane(name, _rows(tensor, layouts[group], blocks), offset)
            planes.append(plane)
            offset += plane.block_bytes
    assert num_blocks is not None and block_tokens is not None
    return KVCaches(tuple(planes), {g: layouts[g] for g in by_group}, num_blocks, offset, devices.pop(), block_tokens)


def allocate_kv_caches(layout: str, num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device | str,
                       num_groups: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Uninitialised caches in `layout` and their groups (layers split evenly), shaped as engines allocate them;
    what tests and benchmarks register."""
    if layout not in LAYOUTS or num_layers % num_groups:
        raise LayoutError(f"cannot allocate {num_layers} layers in {num_groups} groups of layout {layout!r}")
    per_group = num_layers // num_groups
    shapes = {
        "kv-first": (2, num_blocks, block_size, num_heads, head_dim),
        "blocks-first": (num_blocks, 2, block_size, num_heads, head_dim),
        "mla": (num_blocks, block_size, head_dim),
    }
    caches: dict[str, torch.Tensor] = {}
    groups: dict[str, list[str]] = {}
    for g in range(num_groups):
        if layout == "cross-layer":
            name = f"group{g}.layers"
            caches[name] = torch.empty((num_blocks, per_group, 2, block_size, num_heads, head_dim),
                                       dtype=dtype, device=device)
            groups[f"group{g}"] = [name]
            continue
        names = [f"layer{g * per_group + i}" for i in range(per_group)]
        for name in names:
            caches[name] = torch.empty(shapes[layout], dtype=dtype, device=device)
        groups[f"group{g}"] = names
    return caches, groups
