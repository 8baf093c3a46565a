"""The TTFT bench's tail forward on a GPU: its layers replayed as CUDA graphs compute the eager forward's logits, and
each layer's graphs read the prefix that layer's `fill` put into the buffer all layers share."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

pytestmark = pytest.mark.gpu
SHAPE = dict(num_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
             head_dim=32, vocab_size=1000)
PREFIX, TAIL = 96, 16


def filled(prefixes: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
    def fill(i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        keys.copy_(prefixes[i][0])
        values.copy_(prefixes[i][1])
    return fill


def test_a_replayed_tail_computes_the_eager_tail_s_logits_from_each_layer_s_own_prefix() -> None:
    """The first call runs eagerly and captures; the second replays. The control fills nothing when replayed, so
    every layer attends over the last layer's prefix, which the buffer still holds: its logits must differ."""
    pytest.importorskip("transformers")
    from kvfsm.bench.llama import TailForward
    from kvfsm.bench.ttft import Shape, build_model

    torch.manual_seed(0)
    model = build_model(Shape(**SHAPE), PREFIX + TAIL, torch.device("cuda"))
    ids = torch.randint(0, SHAPE["vocab_size"], (1, TAIL), device="cuda")
    shape = (1, SHAPE["num_key_value_heads"], PREFIX, SHAPE["head_dim"])
    prefixes = [(torch.randn(shape, dtype=torch.bfloat16, device="cuda"),
                 torch.randn(shape, dtype=torch.bfloat16, device="cuda")) for _ in range(SHAPE["num_layers"])]
    forward = TailForward(model)
    eager = forward(ids, PREFIX, filled(prefixes)).float()
    replayed = forward(ids, PREFIX, filled(prefixes)).float()
    stale = forward(ids, PREFIX, lambda i, keys, values: None).float()
    torch.cuda.synchronize()
    assert torch.allclose(replayed, eager, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(stale, eager, rtol=1e-2, atol=1e-2)
