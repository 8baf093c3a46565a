"""checksum with the shared tier: a block fetched into a CPU slot that never held a stored block loads checked, against
the checksum its first store took (carried in the value, under the MAC), or, for a value written by an engine
without checksums, one taken when its fetch verified it."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("mooncake.store")

from test_connector_checksum_tiers import rot_fetched_slots  # noqa: E402
from test_mooncake_tier import PROMPT, clean, from_store, serve  # noqa: E402

from kvfsm.engine.oracle import expected_tokens  # noqa: E402
from kvfsm.executor import SimDevice  # noqa: E402
from kvfsm.testing.harness import Harness  # noqa: E402


def fetched_by_a_fresh_engine(mooncake, tenant: str, writer_checksum: bool, rot: bool) -> Harness:
    a = engine_with_checksum(mooncake, tenant, writer_checksum)
    serve(a, PROMPT)
    clean(a)
    b = engine_with_checksum(mooncake, tenant, True)
    if rot:
        rot_fetched_slots(b)
    serve(b, PROMPT)
    return b


def engine_with_checksum(mooncake, tenant: str, checksum: bool) -> Harness:
    return Harness(SimDevice(), num_gpu_blocks=12, cpu_blocks=8, checksum=checksum,
                   mooncake_master=str(mooncake.address), mooncake_options={"tenant": tenant})


@pytest.mark.parametrize("writer_checksum", [True, False])
def test_a_block_fetched_into_a_never_stored_slot_loads_checked(mooncake, tenant, writer_checksum: bool) -> None:
    b = fetched_by_a_fresh_engine(mooncake, tenant, writer_checksum, rot=False)
    assert from_store(b) > 0 and b.connector.scheduler.stats.loads_failed == 0
    clean(b)


def test_a_block_fetched_into_a_never_stored_slot_that_changed_before_its_load_fails_the_load(mooncake,
                                                                                           tenant) -> None:
    b = fetched_by_a_fresh_engine(mooncake, tenant, writer_checksum=True, rot=True)
    assert b.connector.scheduler.stats.loads_failed > 0, "a changed fetched block was loaded unchecked"
    [output] = [tokens for tokens in b.engine.outputs().values()]
    assert output == list(expected_tokens(PROMPT, 3, b.shape))
    b.close()


@pytest.fixture
def tenant() -> str:
    return uuid.uuid4().hex
