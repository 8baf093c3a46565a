"""Authenticated values: a value in the shared store that this tenant did not seal, planted by another client of the
same master, is a miss (counted), and none of its bytes reach a GPU block; a key a write-back finds present is
published only once the value there verifies; the tenant's secret is read at start-up and never shown."""

from __future__ import annotations

import hashlib
import logging
import uuid
import zlib

import numpy as np
import pytest
import torch

pytest.importorskip("mooncake.store")

from test_mooncake_tier import PROMPT, clean, drive, engine, failures, from_store, serve  # noqa: E402

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from kvfsm.config import MooncakeTierConfig  # noqa: E402
from kvfsm.connector.prometheus import KvfsmCollector  # noqa: E402
from kvfsm.mooncake.errors import ChecksumMismatch  # noqa: E402
from kvfsm.mooncake.secret import SecretUnavailable, ValueKey, load_value_key  # noqa: E402
from kvfsm.mooncake.value import TAG_BYTES, TRAILER, TRAILER_BYTES, ValueMac, trailer_key  # noqa: E402
from kvfsm.testing.harness import Harness  # noqa: E402
from kvfsm.testing.mooncake_store import tenant_mac, unchecked_fetch  # noqa: E402

FORGED = 0xA5
"""Every byte of a forged payload: a run of them in a GPU block means forged bytes reached it."""
FORGERIES = ["old-style trailer", "the tenant's trailer on other bytes", "sealed with another secret"]
OTHER_SECRET = b"a secret the victim tenant never held, 32+ bytes"


def old_style_trailer(key: str, payload: bytes) -> bytes:
    """What values carried before the MAC (an unkeyed tag of the key and the payload's CRC-32, which anyone can
    compute for any bytes), laid out in today's trailer with the right length, so that only the MAC tells it apart."""
    return TRAILER.pack(hashlib.blake2b(key.encode(), digest_size=TAG_BYTES).digest(), zlib.crc32(payload), 1,
                        len(payload))


def plant(forger, keys: list[str], block_bytes: int, forgery: str) -> None:
    """The forger, another client of the same master who knows the victim's key scheme and tenant name, replaces
    the value under each key with FORGED bytes."""
    store = forger.raw()
    payload = bytes([FORGED]) * block_bytes
    for key in keys:
        real = store.get(trailer_key(key))
        assert len(store.get(key)) == block_bytes and len(real) == TRAILER_BYTES
        assert store.remove(key, True) == 0 and store.remove(trailer_key(key), True) == 0
        if forgery == "sealed with another secret":
            buffer = torch.full((block_bytes,), FORGED, dtype=torch.uint8).numpy()
            trailer = np.zeros(TRAILER_BYTES, dtype=np.uint8)
            assert not isinstance(forger.write_back([key], [buffer], [trailer]).wait(10.0)[0], Exception)
            continue
        trailer = old_style_trailer(key, payload) if forgery == "old-style trailer" else bytes(real)
        assert store.put(key, payload) == 0 and store.put(trailer_key(key), trailer) == 0


def forged_bytes_on_gpu(harness: Harness) -> int:
    """8-byte runs of FORGED bytes in the engine's GPU KV cache (the KV the toy model computes has none)."""
    runs = 0
    for cache in harness.engine.caches:
        raw = cache.contiguous().view(torch.uint8).reshape(-1)
        rows = raw[:raw.numel() // 8 * 8].reshape(-1, 8)
        runs += int((rows == FORGED).all(dim=1).sum())
    return runs


def forged_fetch(mooncake, connect, tenant: str, forgery: str, mutant: bool) -> Harness:
    a = engine(mooncake, tenant=tenant)
    serve(a, PROMPT)
    hashes = [entry.key for entry in a.mooncake.entries]
    keys = [a.mooncake.store_key(key) for key in hashes]
    block_bytes = a.mooncake.block_bytes
    clean(a)
    plant(connect(mooncake, mac=tenant_mac(OTHER_SECRET, tenant)), keys, block_bytes, forgery)
    b = engine(mooncake, tenant=tenant)
    if mutant:
        unchecked_fetch(b.engine, b.connector)
    b.mooncake_faults.corrupted.update(hashes)  # the checks know these values were replaced on purpose
    b.add_request(PROMPT, max_new_tokens=3)
    drive(b)
    return b


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_value_is_a_counted_miss_and_no_byte_of_it_reaches_a_gpu_block(mooncake, connect, tenant, caplog,
                                                                              forgery: str) -> None:
    with caplog.at_level(logging.WARNING):
        b = forged_fetch(mooncake, connect, tenant, forgery, mutant=False)
    assert failures(b).get("corrupt", 0) > 0 and b.mooncake.rejected_values > 0
    assert "MAC does not verify" in caplog.text
    assert from_store(b) == 0 and b.connector.scheduler.stats.blocks_loaded == 0
    assert forged_bytes_on_gpu(b) == 0
    clean(b)


@pytest.mark.parametrize("forgery", FORGERIES)
def test_control_without_the_mac_a_forged_value_reaches_the_gpu_and_is_caught(mooncake, connect, tenant,
                                                                            forgery: str) -> None:
    b = forged_fetch(mooncake, connect, tenant, forgery, mutant=True)
    assert from_store(b) > 0 and forged_bytes_on_gpu(b) > 0
    found = b.final_violations()
    b.close()
    assert any(line.startswith(("ready-means-written", "output")) for line in found), found


def write_onto_planted(mooncake, connect, key: str, mutant: bool) -> object:
    """A forger seals a value under `key` with a secret of its own; then the victim writes the key back."""
    victim, forger = connect(mooncake), connect(mooncake, mac=tenant_mac(OTHER_SECRET))
    if mutant:
        victim.verify_value = lambda trailer, key, payload: None
    block = 4096
    plant_buffer = torch.full((block,), FORGED, dtype=torch.uint8).numpy()
    assert not isinstance(forger.write_back([key], [plant_buffer], [np.zeros(TRAILER_BYTES, np.uint8)]).wait(10.0)[0],
                          Exception)
    mine = torch.arange(block, dtype=torch.int32).to(torch.uint8).numpy()
    [answer] = victim.write_back([key], [mine], [np.zeros(TRAILER_BYTES, np.uint8)]).wait(10.0)
    return answer


def test_a_write_back_onto_a_key_holding_a_forged_value_is_refused(mooncake, connect, request) -> None:
    answer = write_onto_planted(mooncake, connect, request.node.name, mutant=False)
    assert isinstance(answer, ChecksumMismatch), answer  # the tier then fails the key: never published


def test_control_without_the_mac_a_write_back_takes_a_forged_value_present_for_its_own(mooncake, connect,
                                                                                   request) -> None:
    answer = write_onto_planted(mooncake, connect, request.node.name, mutant=True)
    assert isinstance(answer, int), answer


def test_a_write_back_onto_a_key_holding_the_tenants_own_value_counts_as_written(mooncake, connect, request) -> None:
    client, block = connect(mooncake), torch.arange(4096, dtype=torch.int32).to(torch.uint8).numpy()
    first, again = [client.write_back([request.node.name], [block], [np.zeros(TRAILER_BYTES, np.uint8)]).wait(10.0)
                    for _ in range(2)]
    assert isinstance(first[0], int) and again == first


# --- the secret ------------------------------------------------------------------------------------------------

SECRET = "s3cr3t-" + "x" * 40


def same_key(one: ValueKey, other: ValueKey) -> bool:
    """Whether a value sealed under `one` verifies under `other` (a key never shows its bytes)."""
    payload, trailer = np.arange(64, dtype=np.uint8), np.zeros(TRAILER_BYTES, np.uint8)
    ValueMac(one).seal(trailer, "k", payload)
    try:
        ValueMac(other).check(trailer, "k", payload)
    except ChecksumMismatch:
        return False
    return True


@pytest.mark.parametrize("problem", ["unset variable", "missing file", "short secret", "a directory"])
def test_a_secret_that_cannot_be_used_is_a_named_error_at_start_up(tmp_path, monkeypatch, problem: str) -> None:
    monkeypatch.delenv("KVFSM_TEST_SECRET", raising=False)
    file = {"missing file": tmp_path / "absent", "a directory": tmp_path}.get(problem)
    if problem == "short secret":
        monkeypatch.setenv("KVFSM_TEST_SECRET", "too-short")
    with pytest.raises(SecretUnavailable) as refused:
        load_value_key(file, "KVFSM_TEST_SECRET", "tenant")
    assert "too-short" not in str(refused.value)


def test_the_secret_is_never_shown(tmp_path, monkeypatch, mooncake, caplog) -> None:
    monkeypatch.setenv("KVFSM_TEST_SECRET", SECRET)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    key = load_value_key(secret_file, "UNUSED", "tenant")
    assert same_key(key, load_value_key(None, "KVFSM_TEST_SECRET", "tenant"))
    config = MooncakeTierConfig(master=str(mooncake.address), model_id="m", kv_dtype="bfloat16",
                                secret_env="KVFSM_TEST_SECRET")
    with caplog.at_level(logging.DEBUG):
        b = engine(mooncake, secret_env="KVFSM_TEST_SECRET")
        serve(b, PROMPT)
    registry = CollectorRegistry()
    registry.register(KvfsmCollector.of(b.connector.scheduler))
    shown = [repr(key), str(key), repr(ValueMac(key)), repr(config), repr(b.mooncake.client.mac), caplog.text,
             repr(b.connector.scheduler.stats), repr(b.connector.scheduler.tiers.stats),
             repr(b.connector.take_events()), generate_latest(registry).decode()]
    assert not any(SECRET in text or SECRET[:16] in text for text in shown)
    with pytest.raises(TypeError):
        __import__("pickle").dumps(key)
    clean(b)


def test_two_tenants_under_one_secret_get_two_keys() -> None:
    one, two = ValueKey.derive(SECRET.encode(), "a"), ValueKey.derive(SECRET.encode(), "b")
    assert same_key(one, one) and not same_key(one, two)


@pytest.fixture
def tenant() -> str:
    return uuid.uuid4().hex
