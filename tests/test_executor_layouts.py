"""Registration of KV caches: what each layout's block is, and a `LayoutError` for everything that cannot be copied
exactly."""

from __future__ import annotations

import pytest
import torch

from kvfsm.config import OffloadConfig
from kvfsm.connector import Connector
from kvfsm.executor import LAYOUTS, LayoutError, register_kv_caches
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.executor.sim import SimDevice

BLOCK_BYTES = {  # 4 layers, 16-token blocks, 2 heads, 8 dims, bf16 (MLA: one 8-dim latent per token)
    "kv-first": 4 * 2 * 16 * 2 * 8 * 2,
    "blocks-first": 4 * 2 * 16 * 2 * 8 * 2,
    "mla": 4 * 16 * 8 * 2,
    "cross-layer": 4 * 2 * 16 * 2 * 8 * 2,
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_gpu_block_is_every_layer_of_every_group(layout: str) -> None:
    tensors, groups = allocate_kv_caches(layout, 4, 10, 16, 2, 8, torch.bfloat16, "cpu", num_groups=2)
    caches = register_kv_caches(tensors, layout, groups)
    assert caches.num_blocks == 10
    assert caches.gpu_block_bytes == BLOCK_BYTES[layout]
    assert caches.block_contiguous == (layout != "kv-first")


def test_groups_may_have_their_own_layouts() -> None:
    kv, _ = allocate_kv_caches("kv-first", 2, 6, 4, 1, 8, torch.float16, "cpu")
    mla, _ = allocate_kv_caches("mla", 1, 6, 4, 1, 8, torch.float16, "cpu")
    tensors = {**kv, "latent": mla["layer0"]}
    caches = register_kv_caches(tensors, {"attn": "kv-first", "mla": "mla"},
                                {"attn": list(kv), "mla": ["latent"]})
    assert caches.gpu_block_bytes == 2 * 2 * 4 * 8 * 2 + 4 * 8 * 2
    assert [p.offset for p in caches.planes] == [0, 128, 256]


def kv(shape: tuple[int, ...] = (2, 6, 4, 1, 8), **kwargs: object) -> torch.Tensor:
    return torch.zeros(shape, dtype=kwargs.pop("dtype", torch.bfloat16), **kwargs)  # type: ignore[arg-type]


BAD = {
    "unknown layout": (lambda: {"a": kv()}, "paged", None),
    "kv-first without the K/V axis": (lambda: {"a": kv((3, 6, 4, 1, 8))}, "kv-first", None),
    "blocks-first with K/V in front": (lambda: {"a": kv()}, "blocks-first", None),
    "mla with heads": (lambda: {"a": kv()}, "mla", None),
    "cross-layer per-layer shape": (lambda: {"a": kv((6, 4, 1, 8, 2))}, "cross-layer", None),
    "mismatched block counts": (lambda: {"a": kv(), "b": kv((2, 7, 4, 1, 8))}, "kv-first", None),
    "non-contiguous": (lambda: {"a": kv((2, 4, 6, 1, 8)).transpose(1, 2)}, "kv-first", None),
    "float64": (lambda: {"a": kv(dtype=torch.float64)}, "kv-first", None),
    "bool": (lambda: {"a": kv(dtype=torch.bool)}, "kv-first", None),
    "meta device": (lambda: {"a": kv(device="meta")}, "kv-first", None),
    "empty": (lambda: {"a": kv((2, 0, 4, 1, 8))}, "kv-first", None),
    "no caches": (lambda: {}, "kv-first", None),
    "not a tensor": (lambda: {"a": [1, 2]}, "kv-first", None),
    "layer in two groups": (lambda: {"a": kv()}, "kv-first", {"g": ["a"], "h": ["a"]}),
    "layer in no group": (lambda: {"a": kv(), "b": kv()}, "kv-first", {"g": ["a"]}),
    "group names an unknown layer": (lambda: {"a": kv()}, "kv-first", {"g": ["a", "z"]}),
    "empty group": (lambda: {"a": kv()}, "kv-first", {"g": ["a"], "h": []}),
    "group without a layout": (lambda: {"a": kv()}, {"other": "kv-first"}, {"g": ["a"]}),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_registration_raises_layout_error(case) -> None:
    tensors, layout, groups = case
    with pytest.raises(LayoutError):
        register_kv_caches(tensors(), layout, groups)


def test_the_same_caches_register_when_well_formed() -> None:
    """Control for the table above: the base tensor it distorts registers."""
    assert register_kv_caches({"a": kv(), "b": kv()}, "kv-first").num_blocks == 6


def test_a_connector_registers_each_layer_group_the_engine_names() -> None:
    tensors, groups = allocate_kv_caches("kv-first", 4, 10, 16, 2, 8, torch.bfloat16, "cpu", num_groups=2)
    connector = Connector(OffloadConfig(cpu_blocks=8, gpu_block_size=16), SimDevice())
    caches = connector.register_kv_caches(tensors, "kv-first", groups)
    assert caches.layouts == {"group0": "kv-first", "group1": "kv-first"}
