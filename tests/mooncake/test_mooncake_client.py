"""The client against a real master: zero-copy round trips, and every store fault as a named per-key result."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("mooncake.store")

from kvfsm.mooncake.client import ClientSettings, MooncakeClient, Pending, SlotRegion  # noqa: E402
from kvfsm.mooncake.errors import (  # noqa: E402
    ChecksumMismatch, KeyMissing, StoreBusy, StoreFull, StoreTimeout, StoreUnavailable,
)
from kvfsm.mooncake.local import MasterAddress, free_loopback_port  # noqa: E402

SLOT = 64 << 10
WAIT_S = 10.0


def region(num_slots: int = 8, seed: int = 0) -> SlotRegion:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (num_slots * SLOT,), dtype=torch.uint8, generator=generator)
    return SlotRegion(data, SLOT)


def registered(client: MooncakeClient, num_slots: int = 8, seed: int = 0) -> SlotRegion:
    r = region(num_slots, seed)
    client.register(r)
    return r


def answer(pending: Pending) -> object:
    return pending.wait(WAIT_S)


def test_write_back_then_fetch_round_trips_bytes_exactly(mooncake, connect, request) -> None:
    client = connect(mooncake)
    source, target = registered(client, seed=1), registered(client, seed=2)
    keys = [f"{request.node.name}-{i}" for i in range(4)]
    assert answer(client.write_back(source, keys, [0, 1, 2, 3])) == [None] * 4
    assert answer(client.contains(keys + ["absent"])) == [True] * 4 + [False]
    assert answer(client.fetch(target, keys, [7, 6, 5, 4])) == [None] * 4
    for src, dst in zip([0, 1, 2, 3], [7, 6, 5, 4]):
        assert (target.payload(dst) == source.payload(src)).all()


def test_another_engine_reads_what_one_wrote(mooncake, connect, request) -> None:
    writer, reader = connect(mooncake), connect(mooncake)
    source, target = registered(writer, seed=3), registered(reader, seed=4)
    key = f"{request.node.name}"
    assert answer(writer.write_back(source, [key], [2])) == [None]
    assert answer(reader.fetch(target, [key], [0])) == [None]
    assert (target.payload(0) == source.payload(2)).all()


def test_writing_a_key_twice_is_not_an_error(mooncake, connect, request) -> None:
    client = connect(mooncake)
    source = registered(client)
    key = request.node.name
    assert answer(client.write_back(source, [key], [0])) == [None]
    assert answer(client.write_back(source, [key], [0])) == [None]


def test_a_missing_key_is_key_missing(mooncake, connect, request) -> None:
    client = connect(mooncake)
    target = registered(client)
    [result] = answer(client.fetch(target, [request.node.name], [0]))
    assert isinstance(result, KeyMissing)


@pytest.mark.parametrize("corruption", ["flipped byte", "other length", "other key's value"])
def test_a_corrupted_value_is_a_checksum_mismatch(mooncake, connect, request, corruption: str) -> None:
    client = connect(mooncake)
    source, target = registered(client, seed=5), registered(client, seed=6)
    key = request.node.name
    store = client.raw()
    if corruption == "other key's value":
        assert answer(client.write_back(source, [key + "-other"], [1])) == [None]
        raw = store.get(key + "-other")
        assert store.put(key, raw) == 0
    else:
        assert answer(client.write_back(source, [key], [1])) == [None]
        raw = bytearray(store.get(key))
        raw = raw[:-1] if corruption == "other length" else raw
        raw[100] ^= 0xFF
        assert store.remove(key, True) == 0
        assert store.put(key, bytes(raw)) == 0
    [result] = answer(client.fetch(target, [key], [0]))
    assert isinstance(result, ChecksumMismatch), result


def test_a_full_store_refuses_writes_as_store_full(fresh_mooncake, connect, request) -> None:
    hog, client = connect(fresh_mooncake), connect(fresh_mooncake)
    from mooncake.store import ReplicateConfig
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    chunk = bytes(4 << 20)
    codes = [hog.raw().put(f"hog-{i}", chunk, pinned) for i in range(32)]
    assert any(code != 0 for code in codes), "the segment never filled"
    big = SlotRegion(torch.zeros(2 * (8 << 20), dtype=torch.uint8), 8 << 20)
    client.register(big)
    results = answer(client.write_back(big, [request.node.name + "-a", request.node.name + "-b"], [0, 1]))
    assert any(isinstance(result, StoreFull) for result in results), results


def test_a_killed_master_is_store_unavailable_and_a_restarted_one_serves_again(fresh_mooncake, connect,
                                                                              request) -> None:
    client = connect(fresh_mooncake, op_timeout_s=1.0, retry_after_s=0.5)
    source = registered(client)
    fresh_mooncake.kill_master()
    [result] = answer(client.write_back(source, [request.node.name], [0]))
    assert isinstance(result, (StoreUnavailable, StoreTimeout)), result
    [refused] = answer(client.write_back(source, [request.node.name], [0]))
    assert isinstance(refused, StoreUnavailable)
    fresh_mooncake.restart_master()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if answer(client.write_back(source, [request.node.name], [0])) == [None]:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the client never served again after the master restarted")
    target = registered(client, seed=9)
    assert answer(client.fetch(target, [request.node.name], [3])) == [None]
    assert (target.payload(3) == source.payload(0)).all()


def test_a_stalled_master_times_out_and_the_slot_stays_busy_until_the_call_returns(fresh_mooncake, connect,
                                                                                   request) -> None:
    client = connect(fresh_mooncake, op_timeout_s=0.3)
    source = registered(client)
    assert answer(client.write_back(source, [request.node.name], [0])) == [None]
    fresh_mooncake.pause_master()
    try:
        pending = client.fetch(source, [request.node.name], [1])
        started = time.monotonic()
        while (result := pending.poll()) is None:
            time.sleep(0.01)
        assert isinstance(result, StoreTimeout)
        assert time.monotonic() - started < 2.0
        assert not pending.settled
    finally:
        fresh_mooncake.resume_master()
    deadline = time.monotonic() + 30
    while not pending.settled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pending.settled
    assert isinstance(pending.poll(), StoreTimeout), "a call reported timed out stays timed out"


def test_calls_beyond_the_backlog_bound_are_refused_as_busy(fresh_mooncake, connect, request) -> None:
    client = connect(fresh_mooncake, op_timeout_s=5.0, max_pending=2)
    source = registered(client)
    fresh_mooncake.pause_master()
    try:
        first = [client.contains([f"{request.node.name}-{i}"]) for i in range(2)]
        [refused] = answer(client.contains([request.node.name]))
        assert isinstance(refused, StoreBusy)
    finally:
        fresh_mooncake.resume_master()
    assert all(answer(p) == [False] for p in first)
    assert answer(client.write_back(source, [request.node.name], [0])) == [None]


def test_connecting_to_no_master_fails_at_once() -> None:
    client = MooncakeClient(ClientSettings(master=MasterAddress(host="127.0.0.1", port=free_loopback_port())))
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        client.connect()
    assert time.monotonic() - started < 2.0
    client.close()
