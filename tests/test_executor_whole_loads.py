"""A load from fragmented CPU slots goes out whole, in its first layer segment (`transfer.MIN_LAYER_COPY_BYTES`).

A layer segment copies each run of consecutive slots once, so fragmented slots make many small copies, which the
copy engine moves at a fraction of its bandwidth. A gathering mechanism then sends the whole load through staging
in copies of whole blocks. The rule it must keep is the per-layer one: each layer's event follows every byte of
that layer, which here means every byte of the load is before the first event.

The caches of these tests have pieces of a few bytes, so any load from more than one run of slots is one the rule
sends whole.
"""

from __future__ import annotations

import pytest
import torch

from kvfsm.executor import SimDevice, Transfers, transfer
from kvfsm.executor.sim import SimEvent
from kvfsm.executor.transfer import Segments
from test_executor_transfer import block, make

FRAGMENTED, ONE_RUN = (5, 1, 3), (3, 4, 5)
"""CPU slots of a three-block load: three runs, and one."""
GPU_BLOCKS = (2, 7, 9)


def stored(slots: tuple[int, ...]) -> tuple[SimDevice, Transfers, list[torch.Tensor]]:
    """Caches whose blocks 0-2 were stored into `slots`, and those blocks' bytes."""
    device, caches, _, transfers = make("kv-first", 1, "staged-gather")
    transfers.store([0, 1, 6], slots)
    device.run_until_idle()
    return device, transfers, [block(caches, b).clone() for b in (0, 1, 6)]


def sent(device: SimDevice, segments: Segments, count: int) -> list[SimEvent]:
    """Every segment of a load enqueued in order, each followed by its event, as the worker sends them."""
    events = []
    for segment in range(count):
        segments.enqueue(segment, f"load layer {segment}")
        events.append(device.new_event())
        device.record("load", events[-1])
    return events


def test_a_load_from_fragmented_cpu_slots_goes_out_whole_in_its_first_segment() -> None:
    device, transfers, expected = stored(FRAGMENTED)
    caches = transfers._caches
    segments = transfers.load_segments(FRAGMENTED, GPU_BLOCKS)
    count = transfers.num_segments
    assert segments.whole
    assert [segments.nbytes(s) for s in range(count)] == [3 * caches.gpu_block_bytes] + [0] * (count - 1)
    sent(device, segments, count)
    device.run_until_idle()
    writes = {(a.label, a.block, a.layer) for a in device.accesses if a.mode == "write" and a.space == "gpu"}
    assert writes == {("load layer 0", b, None) for b in GPU_BLOCKS}
    assert all(torch.equal(block(caches, b), want) for b, want in zip(GPU_BLOCKS, expected))


def test_a_load_from_one_run_of_cpu_slots_goes_out_a_layer_at_a_time() -> None:
    device, transfers, expected = stored(ONE_RUN)
    caches = transfers._caches
    segments = transfers.load_segments(ONE_RUN, GPU_BLOCKS)
    assert not segments.whole
    assert [segments.nbytes(s) for s in range(transfers.num_segments)] == [
        3 * plane.block_bytes for plane in caches.planes]
    sent(device, segments, transfers.num_segments)
    device.run_until_idle()
    assert all(torch.equal(block(caches, b), want) for b, want in zip(GPU_BLOCKS, expected))


@pytest.mark.parametrize(("minimum", "whole"), [(0, False), (1, True)])
def test_a_fragmented_load_goes_out_whole_only_where_its_layer_copies_average_below_the_minimum(
        monkeypatch: pytest.MonkeyPatch, minimum: int, whole: bool) -> None:
    """Four blocks in two runs: a layer segment makes two copies of two blocks' pieces each. At exactly that
    minimum it goes out a layer at a time; one byte more, whole."""
    _, _, _, transfers = make("kv-first", 1, "staged-gather")
    per_copy = 4 * transfers._caches.gpu_block_bytes // transfers.num_segments // 2
    monkeypatch.setattr(transfer, "MIN_LAYER_COPY_BYTES", per_copy + minimum)
    assert transfers.load_segments((5, 6, 1, 2), (0, 1, 2, 3)).whole is whole


def test_stores_dma_only_loads_and_one_segment_caches_always_go_out_a_layer_at_a_time() -> None:
    """A store's segments each wait for their own layer's compute, so one cannot carry the others; a DMA-only
    mechanism copies the same pieces either way; a cross-layer cache has one segment already."""
    _, _, _, gathering = make("kv-first", 1, "staged-gather")
    _, _, _, dma_only = make("kv-first", 1, "copy-per-block")
    _, _, _, cross_layer = make("cross-layer", 1, "staged-gather")
    assert not gathering.store_segments(GPU_BLOCKS, FRAGMENTED).whole
    assert not dma_only.load_segments(FRAGMENTED, GPU_BLOCKS).whole
    assert not cross_layer.load_segments(FRAGMENTED, GPU_BLOCKS).whole


class LateWhole(Segments):
    """A control: the whole load sent with the last segment, after the earlier layers' events were recorded."""

    def enqueue(self, segment: int, label: str) -> None:
        if segment == self._transfers.num_segments - 1:
            super().enqueue(0, label)


@pytest.mark.parametrize(("kind", "safe"), [(Segments, True), (LateWhole, False)])
def test_every_layer_s_event_follows_every_byte_of_a_load_sent_whole(kind: type[Segments], safe: bool) -> None:
    """Each layer's wait (`wait_for_layer_load`) follows that layer's event: once layer 0's event ran, every byte
    of every layer must have landed. The control, sending the load with the last segment, leaves them unwritten."""
    device, transfers, expected = stored(FRAGMENTED)
    caches = transfers._caches
    segments = kind(transfers, "load", transfers._load_placement(FRAGMENTED, GPU_BLOCKS, 0), FRAGMENTED)
    assert segments.whole
    events = sent(device, segments, transfers.num_segments)
    device.synchronize(events[0])
    landed = all(torch.equal(block(caches, b), want) for b, want in zip(GPU_BLOCKS, expected))
    assert landed is safe
