"""What `open_mooncake` hands a Mooncake tier and its client, on a real master: every client setting of the config,
the tier's lookup bound, name and lookup-history flag, the CPU pool registered whole with the first call, and values
sealed under the key of the configured secret (a file before the environment) and tenant; a block bigger than a
head-major shadow chunk gets a chunk of its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from kvfsm.bindings import default_spec  # noqa: E402
from kvfsm.machines import MachineSet  # noqa: E402
from kvfsm.mooncake.local import MasterAddress  # noqa: E402
from kvfsm.mooncake.secret import load_value_key  # noqa: E402
from kvfsm.mooncake.settings import ClientSettings  # noqa: E402
from kvfsm.mooncake.value import ValueMac, trailer_key  # noqa: E402
from kvfsm.tiers.mooncake import SHADOW_CHUNK_BYTES, MooncakeTier  # noqa: E402
from test_mooncake_heads import completion  # noqa: E402
from test_mooncake_tier_reads import JOB_IDS, open_tier, view  # noqa: E402

KEY = 0x71
CHECKSUM = 0xBEEF


def test_a_tier_s_client_gets_every_client_setting_of_its_config(mooncake) -> None:
    tier_, _ = open_tier(mooncake, segment_bytes=16 << 20, op_timeout_s=7.0, retry_after_s=3.0, max_pending=5,
                         hash_threads=3)
    try:
        assert tier_.client.settings == ClientSettings(
            master=MasterAddress.parse(str(mooncake.address)), segment_bytes=16 << 20, op_timeout_s=7.0,
            retry_after_s=3.0, max_pending=5, hash_threads=3)
    finally:
        tier_.close()


def test_a_tier_gets_its_name_lookup_bound_and_lookup_history_flag(mooncake) -> None:
    tier_, _ = open_tier(mooncake, keep_lookups=True, lookup_timeout_s=9.0, name="shared")
    try:
        assert (tier_.name, tier_.entries.tier) == ("shared", "shared")
        assert tier_.lookup_timeout_s == 9.0
        assert tier_.entries.keep_lookups is True
    finally:
        tier_.close()


def test_a_tier_registers_its_whole_cpu_pool_with_its_first_call(mooncake) -> None:
    """Zero-copy: every slot view handed in later is covered by the one registration."""
    tier_, pool = open_tier(mooncake)
    try:
        job = next(JOB_IDS)
        tier_.submit_write(job, [KEY], [view(pool, 0)])
        assert completion(tier_, job).ok
        buffer = pool.buffer.numpy()
        assert tier_.client._registered.covers(int(buffer.ctypes.data), buffer.nbytes)
    finally:
        tier_.close()


def test_a_tier_seals_its_values_under_its_secret_file_s_key_for_its_tenant(mooncake, tmp_path: Path) -> None:
    """The file wins over the environment variable (which the test suite sets to another secret)."""
    secret_file = tmp_path / "secret"
    secret_file.write_text("a file's secret, thirty-two bytes or more\n")
    tier_, pool = open_tier(mooncake, secret_file=secret_file)
    try:
        pool.slot(0).fill_(0x3C)
        job = next(JOB_IDS)
        tier_.submit_write(job, [KEY], [view(pool, 0)], [CHECKSUM])
        assert completion(tier_, job).ok
        name = tier_.store_key(KEY)
        payload, trailer = (np.frombuffer(tier_.client.raw().get(n), np.uint8) for n in (name, trailer_key(name)))
        mac = ValueMac(load_value_key(secret_file, "UNUSED", tier_.tenant))
        assert mac.check(trailer, name, payload) == CHECKSUM
    finally:
        tier_.close()


def test_a_per_head_tier_registers_each_shadow_chunk_whole_with_the_call_that_first_uses_it(mooncake) -> None:
    """As the pool: one registration covers every head value cut from the chunk, not one per value on first use."""
    tier_, pool = open_tier(mooncake, kv_heads=4)
    try:
        job = next(JOB_IDS)
        tier_.submit_write(job, [KEY], [view(pool, 0)])
        assert completion(tier_, job).ok
        _, chunk = tier_._shadows.item_for(pool.slot(0).numpy())
        assert tier_.client._registered.covers(int(chunk.ctypes.data), chunk.nbytes)
    finally:
        tier_.close()


def test_a_block_bigger_than_a_shadow_chunk_gets_a_chunk_of_its_own(mooncake) -> None:
    """Not two: a per-head tier of big blocks holds one block's shadow per chunk, never twice the memory."""
    tier_, pool = open_tier(mooncake)
    try:
        block_bytes = SHADOW_CHUNK_BYTES + 1
        big = MooncakeTier("big", tier_.client, tier_.namespace, block_bytes, tenant=None, lookup_timeout_s=1.0,
                           keep_lookups=False, pool=pool.buffer.numpy(), index_keys=1, machines=MachineSet(default_spec()),
                           heads=None)
        _, chunk = big._shadows.item_for(np.zeros(block_bytes, np.uint8))
        assert chunk.nbytes == block_bytes
    finally:
        tier_.close()
