"""The client against a real master: zero-copy round trips, and every store fault as a named per-key result."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("mooncake.store")

from kvfsm.mooncake.client import MooncakeClient  # noqa: E402
from kvfsm.mooncake.errors import (  # noqa: E402
    ChecksumMismatch, KeyMissing, StoreBusy, StoreFull, StoreTimeout, StoreUnavailable,
)
from kvfsm.mooncake.host_memory import SlotRegion  # noqa: E402
from kvfsm.mooncake.io_thread import Pending  # noqa: E402
from kvfsm.mooncake.local import MasterAddress, free_loopback_port  # noqa: E402
from kvfsm.mooncake.secret import ValueKey  # noqa: E402
from kvfsm.mooncake.settings import ClientSettings  # noqa: E402
from kvfsm.mooncake.value import TRAILER_BYTES, ValueMac, trailer_key  # noqa: E402
from kvfsm.testing.mooncake_store import tenant_mac  # noqa: E402
from kvfsm.tiers.io import ManualIo  # noqa: E402

SLOT = 64 << 10
WAIT_S = 10.0


def registered(client: MooncakeClient, num_slots: int = 8, seed: int = 0) -> SlotRegion:
    generator = torch.Generator().manual_seed(seed)
    region = SlotRegion(torch.randint(0, 256, (num_slots * SLOT,), dtype=torch.uint8, generator=generator), SLOT)
    client.register(region.buffer)
    return region


def write(client: MooncakeClient, region: SlotRegion, keys: list[str], slots: list[int]) -> Pending:
    return client.write_back(keys, region.payloads(slots), region.trailers_of(slots))


def read(client: MooncakeClient, region: SlotRegion, keys: list[str], slots: list[int]) -> Pending:
    return client.fetch(keys, region.payloads(slots), region.trailers_of(slots))


def moved(pending: Pending) -> bool:
    """Every key moved: its result is a checksum (or no carried one), not a fault."""
    results = pending.wait(WAIT_S)
    return results is not None and not any(isinstance(result, Exception) for result in results)


def faults(pending: Pending) -> list:
    results = pending.wait(WAIT_S)
    assert results is not None, "no answer within the test's wait"
    return results


def test_the_store_of_a_client_not_connected_is_refused_by_name() -> None:
    client = MooncakeClient(ClientSettings(master=MasterAddress.parse(f"127.0.0.1:{free_loopback_port()}")),
                            tenant_mac())
    try:
        with pytest.raises(StoreUnavailable, match="^the Mooncake client is not connected$"):
            client.raw()
    finally:
        client.close()


def test_the_store_of_a_closed_client_is_refused_by_name(mooncake, connect) -> None:
    """A closed store's handle must never be called (it crashes): after `close`, no caller gets it."""
    client = connect(mooncake)
    assert client.close()
    with pytest.raises(StoreUnavailable, match="^the Mooncake client is not connected$"):
        client.raw()


def test_write_back_then_fetch_round_trips_bytes_exactly(mooncake, connect, request) -> None:
    client = connect(mooncake)
    source, target = registered(client, seed=1), registered(client, seed=2)
    keys = [f"{request.node.name}-{i}" for i in range(4)]
    assert moved(write(client, source, keys, [0, 1, 2, 3]))
    assert client.contains(keys + ["absent"]).wait(WAIT_S) == [True] * 4 + [False]
    assert moved(read(client, target, keys, [7, 6, 5, 4]))
    for src, dst in zip([0, 1, 2, 3], [7, 6, 5, 4]):
        assert (target.payload(dst) == source.payload(src)).all()


def test_views_of_unregistered_memory_are_registered_on_first_use(mooncake, connect, request) -> None:
    client = connect(mooncake)
    source = SlotRegion(torch.full((2 * SLOT,), 7, dtype=torch.uint8), SLOT)
    target = SlotRegion(torch.zeros(2 * SLOT, dtype=torch.uint8), SLOT)
    assert moved(write(client, source, [request.node.name], [1]))
    assert moved(read(client, target, [request.node.name], [0]))
    assert (target.payload(0) == 7).all()


def test_another_engine_reads_what_one_wrote(mooncake, connect, request) -> None:
    writer, reader = connect(mooncake), connect(mooncake)
    source, target = registered(writer, seed=3), registered(reader, seed=4)
    assert moved(write(writer, source, [request.node.name], [2]))
    assert moved(read(reader, target, [request.node.name], [0]))
    assert (target.payload(0) == source.payload(2)).all()


def test_writing_a_key_twice_is_not_an_error(mooncake, connect, request) -> None:
    client = connect(mooncake)
    source = registered(client)
    assert moved(write(client, source, [request.node.name], [0]))
    assert moved(write(client, source, [request.node.name], [0]))


def test_a_missing_key_is_key_missing(mooncake, connect, request) -> None:
    client = connect(mooncake)
    [result] = faults(read(client, registered(client), [request.node.name], [0]))
    assert isinstance(result, KeyMissing)


def test_calls_queued_before_close_still_run_on_the_store_and_later_ones_are_refused(mooncake, connect,
                                                                                    request) -> None:
    io = ManualIo()  # the calls stay queued until close runs them
    client = MooncakeClient(ClientSettings(master=mooncake.address), tenant_mac(), io=io)
    client.connect()
    source = SlotRegion(torch.full((2 * SLOT,), 5, dtype=torch.uint8), SLOT)
    queued = write(client, source, [request.node.name], [0])
    assert io.queue and client.close()
    assert moved(queued), "a call queued before close found no store"
    [refused] = faults(write(client, source, [request.node.name], [1]))
    assert isinstance(refused, StoreUnavailable) and not client.connected
    reader = connect(mooncake)
    target = registered(reader)
    assert moved(read(reader, target, [request.node.name], [0])) and (target.payload(0) == 5).all()


@pytest.mark.parametrize("corruption", ["flipped byte", "other length", "other key's value"])
def test_a_corrupted_value_is_a_checksum_mismatch(mooncake, connect, request, corruption: str) -> None:
    client = connect(mooncake)
    source, target = registered(client, seed=5), registered(client, seed=6)
    key = request.node.name
    store = client.raw()
    if corruption == "other key's value":
        assert moved(write(client, source, [key + "-other"], [1]))
        assert store.put(key, store.get(key + "-other")) == 0
        assert store.put(trailer_key(key), store.get(trailer_key(key + "-other"))) == 0
    else:
        assert moved(write(client, source, [key], [1]))
        raw = bytearray(store.get(key))
        raw = raw[:-1] if corruption == "other length" else raw
        raw[100] ^= 0xFF
        assert store.remove(key, True) == 0
        assert store.put(key, bytes(raw)) == 0
    [result] = faults(read(client, target, [key], [0]))
    assert isinstance(result, ChecksumMismatch), result


class ShortReads:
    """The client's store, but every read of an object answers one byte fewer than it moved: a store gone wrong."""

    def __init__(self, store: object) -> None:
        self._store = store

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    def batch_get_into(self, *args: object) -> list[int]:
        return [code - 1 if code > 0 else code for code in self._store.batch_get_into(*args)]


def test_a_read_the_store_answers_short_is_a_checksum_mismatch_naming_both_lengths(mooncake, connect,
                                                                                   request) -> None:
    client = connect(mooncake)
    source, target = registered(client, seed=5), registered(client, seed=6)
    key = request.node.name
    assert moved(write(client, source, [key], [1]))
    client._store = ShortReads(client._store)
    [result] = faults(read(client, target, [key], [0]))
    expected = SLOT + TRAILER_BYTES
    assert isinstance(result, ChecksumMismatch)
    assert str(result) == f"{key}: read {expected - 2} bytes, expected {expected}"  # payload and trailer short


def test_a_full_store_refuses_writes_as_store_full_naming_each_key(fresh_mooncake, connect, request) -> None:
    hog, client = connect(fresh_mooncake), connect(fresh_mooncake)
    from mooncake.store import ReplicateConfig
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    codes = [hog.raw().put(f"hog-{i}", bytes(4 << 20), pinned) for i in range(32)]
    assert any(code != 0 for code in codes), "the segment never filled"
    big = SlotRegion(torch.zeros(2 * (8 << 20), dtype=torch.uint8), 8 << 20)
    keys = [request.node.name + "-a", request.node.name + "-b"]
    results = faults(write(client, big, keys, [0, 1]))
    assert any(isinstance(result, StoreFull) for result in results), results
    for key, result in zip(keys, results, strict=True):
        if isinstance(result, StoreFull):
            assert str(result).startswith(f"write-back of {key}: "), result


def test_a_killed_master_is_store_unavailable_and_a_restarted_one_serves_again(fresh_mooncake, connect,
                                                                              request) -> None:
    client = connect(fresh_mooncake, op_timeout_s=1.0, retry_after_s=0.5)
    source = registered(client)
    fresh_mooncake.kill_master()
    [result] = faults(write(client, source, [request.node.name], [0]))
    assert isinstance(result, StoreUnavailable), result
    assert str(result) == f"write-back of {request.node.name}: the store did not say whether it holds the key"
    [refused] = faults(write(client, source, [request.node.name], [0]))
    assert isinstance(refused, StoreUnavailable)
    fresh_mooncake.restart_master()
    deadline = time.monotonic() + 30
    while not moved(write(client, source, [request.node.name], [0])):
        assert time.monotonic() < deadline, "the client never served again after the master restarted"
        time.sleep(0.5)
    target = registered(client, seed=9)
    assert moved(read(client, target, [request.node.name], [3]))
    assert (target.payload(3) == source.payload(0)).all()


def test_a_lookup_a_killed_master_does_not_answer_is_store_unavailable_naming_each_key(fresh_mooncake, connect,
                                                                                        request) -> None:
    client = connect(fresh_mooncake, op_timeout_s=1.0, retry_after_s=0.5)
    fresh_mooncake.kill_master()
    keys = [f"{request.node.name}-{i}" for i in range(2)]
    refused = faults(client.contains(keys))
    assert [type(fault) for fault in refused] == [StoreUnavailable] * 2, refused
    assert [str(fault) for fault in refused] == [f"lookup of {key} failed" for key in keys]


def test_on_a_stalled_master_queued_calls_time_out_and_a_running_one_answers_when_it_returns(
        fresh_mooncake, connect, request) -> None:
    client = connect(fresh_mooncake, op_timeout_s=0.3, retry_after_s=0.3)
    source = registered(client)
    assert moved(write(client, source, [request.node.name], [0]))
    fresh_mooncake.pause_master()
    try:
        reads = [read(client, source, [request.node.name], [slot]) for slot in (1, 2, 3)]
        time.sleep(1.0)
        answers = [pending.poll() for pending in reads]
        unanswered = [pending for pending, answer in zip(reads, answers) if answer is None]
        assert len(unanswered) <= 1, "only the call already running may wait for the store"
        assert all(not pending.settled for pending in unanswered), "a running call is never reported abandoned"
        assert all(isinstance(answer[0], StoreTimeout) for answer in answers if answer is not None)
        [refused] = faults(read(client, source, [request.node.name], [4]))
        assert isinstance(refused, StoreUnavailable), "a slow store is not queued behind"
    finally:
        fresh_mooncake.resume_master()
    for pending, slot in zip(reads, (1, 2, 3)):
        [result] = faults(pending)
        assert pending.settled
        if isinstance(result, int):
            assert (source.payload(slot) == source.payload(0)).all()


def test_calls_beyond_the_backlog_bound_are_refused_as_busy(fresh_mooncake, connect, request) -> None:
    client = connect(fresh_mooncake, op_timeout_s=5.0, max_pending=2)
    source = registered(client)
    fresh_mooncake.pause_master()
    try:
        first = [client.contains([f"{request.node.name}-{i}"]) for i in range(2)]
        [refused] = faults(client.contains([request.node.name]))
        assert isinstance(refused, StoreBusy)
    finally:
        fresh_mooncake.resume_master()
    assert [p.wait(WAIT_S) for p in first] == [[False], [False]]
    assert moved(write(client, source, [request.node.name], [0]))


def test_connecting_to_no_master_fails_at_once() -> None:
    client = MooncakeClient(ClientSettings(master=MasterAddress(host="127.0.0.1", port=free_loopback_port())),
                            tenant_mac())
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        client.connect()
    assert time.monotonic() - started < 2.0
    assert client.close()


class SlowSeal(ValueMac):
    """A sealer that takes its time, as a loaded host's MAC threads do."""

    def seal(self, *args, **kwargs) -> int:
        time.sleep(0.05)
        return super().seal(*args, **kwargs)


def test_a_write_back_puts_no_trailer_before_it_is_sealed(mooncake, connect, request) -> None:
    """The MACs run on the MAC threads while the payloads move: a trailer put before it was sealed would publish a
    stale trailer, and every fetch of its value would fail."""
    key = ValueKey.derive(b"a test tenant's secret, 32 bytes or more", None)
    client = connect(mooncake, mac=SlowSeal(key), pipeline_bytes=SLOT)
    source, target = registered(client, seed=7), registered(client, seed=8)
    keys = [f"{request.node.name}-{i}" for i in range(4)]
    assert moved(write(client, source, keys, [0, 1, 2, 3]))
    assert moved(read(client, target, keys, [0, 1, 2, 3]))


def test_a_fetch_cut_into_several_gets_answers_every_key_with_its_own_check(mooncake, connect, request) -> None:
    client = connect(mooncake, hash_threads=2, pipeline_bytes=SLOT)  # a round of 2 values: 8 keys, several gets
    source, target = registered(client, seed=3), registered(client, seed=4)
    keys = [f"{request.node.name}-{i}" for i in range(8)]
    assert moved(write(client, source, keys, list(range(8))))
    results = faults(read(client, target, keys, list(range(8))))
    assert len(results) == len(keys) and not any(isinstance(result, Exception) for result in results)
    assert all((target.payload(i) == source.payload(i)).all() for i in range(8))


def test_a_fetch_of_a_missing_key_names_the_fetch_and_the_key(mooncake, connect, request) -> None:
    client = connect(mooncake)
    [fault] = faults(read(client, registered(client), [request.node.name], [0]))
    assert isinstance(fault, KeyMissing) and str(fault).startswith(f"fetch of {request.node.name}: ")
