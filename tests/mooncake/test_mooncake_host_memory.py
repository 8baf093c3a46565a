"""Host memory handed to Mooncake: a slot region (the tests' and the benchmark's source and target memory) refuses,
by name, memory it cannot cut into whole slots of a flat host byte buffer; a slot arena (a Mooncake tier's trailers
and head-major shadows) gives each payload a buffer of its own, a fresh chunk every `per_chunk` payloads; a view's
address is its first byte's, however ctypes takes its buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfsm.mooncake.host_memory import Registrations, SlotRegion, address
from kvfsm.tiers.mooncake import SlotArena

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


def test_a_slot_region_of_one_byte_slots_holds_one_slot_per_byte() -> None:
    assert SlotRegion(torch.zeros(3, dtype=torch.uint8), 1).num_slots == 3


def test_a_slot_arena_gives_each_payload_a_buffer_of_its_own_and_a_fresh_chunk_every_per_chunk_payloads() -> None:
    arena = SlotArena(item_bytes=4, per_chunk=2)
    payloads = [np.zeros(8, dtype=np.uint8) for _ in range(3)]
    items = [arena.item_for(payload) for payload in payloads]
    starts = [int(buffer.ctypes.data) for buffer, _ in items]
    assert len(set(starts)) == 3 and all(buffer.nbytes == 4 for buffer, _ in items)
    assert items[0][1] is items[1][1] and items[2][1] is not items[0][1], "the third payload shares a full chunk"
    assert arena.item_for(payloads[0])[0] is items[0][0], "a payload seen before got another buffer"


def test_a_range_is_covered_only_when_it_ends_inside_a_registration() -> None:
    registered = Registrations()
    registered.add(1000, 100)
    assert registered.covers(1000, 100) and registered.covers(1050, 50)
    assert not registered.covers(1050, 51), "a range running past its registration's end counted as registered"
    assert not registered.covers(900, 10)


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("view", [
    lambda base: base[8:24], lambda base: _read_only(base[8:24]), lambda base: base[1:40:3], lambda base: base[5:5],
], ids=["writable", "read-only", "strided", "empty"])
def test_the_address_of_a_view_is_the_one_numpy_gives_whether_or_not_ctypes_can_borrow_its_buffer(view) -> None:
    array = view(np.arange(64, dtype=np.uint8))
    assert address(array) == array.ctypes.data
