"""A slot region (the tests' and the benchmark's source and target memory) refuses, by name, memory it cannot cut
into whole slots of a flat host byte buffer."""

from __future__ import annotations

import pytest
import torch

from kvfsm.mooncake.host_memory import SlotRegion

FLAT = "a slot region is a flat uint8 host tensor"


@pytest.mark.parametrize(("buffer", "slot_bytes", "message"), [
    (torch.zeros(8, dtype=torch.float32), 4, FLAT),
    (torch.zeros(2, 4, dtype=torch.uint8), 4, FLAT),
    (torch.zeros(8, dtype=torch.uint8), 0, "8 bytes do not cut into slots of 0"),
    (torch.zeros(7, dtype=torch.uint8), 4, "7 bytes do not cut into slots of 4"),
], ids=["float", "two-dimensional", "empty slots", "a partial slot"])
def test_a_slot_region_refuses_what_does_not_cut_into_whole_byte_slots(buffer: torch.Tensor, slot_bytes: int,
                                                                       message: str) -> None:
    with pytest.raises(ValueError) as refused:
        SlotRegion(buffer, slot_bytes)
    assert str(refused.value) == message
