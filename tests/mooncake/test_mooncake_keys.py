"""Key scheme: a key names model, dtype, layout, block size, TP rank and world size, and the tenant's salt; a per-head
key names the head instead of the TP rank and world size, so every TP size of one model agrees on it."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st
from pydantic import ValidationError

from kvfsm.mooncake.keys import KvNamespace, head_key, namespace_name, object_key

BASE = KvNamespace(model_id="org/model@abc", dtype="bfloat16", layout="kv-first", block_tokens=16,
                   tp_rank=0, tp_world_size=2)

VARIANTS = {
    "model": BASE.model_copy(update={"model_id": "org/other@abc"}),
    "revision": BASE.model_copy(update={"model_id": "org/model@def"}),
    "dtype": BASE.model_copy(update={"dtype": "float16"}),
    "layout": BASE.model_copy(update={"layout": "cross-layer"}),
    "block size": BASE.model_copy(update={"block_tokens": 32}),
    "tp rank": BASE.model_copy(update={"tp_rank": 1}),
    "tp world": BASE.model_copy(update={"tp_world_size": 4}),
}


@pytest.mark.parametrize("part", sorted(VARIANTS))
def test_each_part_of_the_namespace_changes_the_key(part: str) -> None:
    assert object_key(VARIANTS[part], 7) != object_key(BASE, 7)


def test_a_salt_changes_the_key_and_an_empty_salt_is_no_salt() -> None:
    assert object_key(BASE, 7, "tenant-a") != object_key(BASE, 7)
    assert object_key(BASE, 7, "tenant-a") != object_key(BASE, 7, "tenant-b")
    assert object_key(BASE, 7, "") == object_key(BASE, 7, None)


@given(st.tuples(st.text(min_size=1), st.text(min_size=1)), st.tuples(st.text(min_size=1), st.text(min_size=1)))
def test_parts_cannot_be_shifted_across_field_boundaries(a: tuple[str, str], b: tuple[str, str]) -> None:
    """Length framing: ("ab", "c") and ("a", "bc") are different producers, so different keys."""
    if a == b:
        return
    one = BASE.model_copy(update={"model_id": a[0], "dtype": a[1]})
    two = BASE.model_copy(update={"model_id": b[0], "dtype": b[1]})
    assert object_key(one, 1) != object_key(two, 1)


def test_keys_are_stable_and_short() -> None:
    key = object_key(BASE, 123456789)
    assert key == object_key(KvNamespace(**BASE.model_dump()), 123456789)
    assert key.startswith("kvfsm4-") and len(key) == len("kvfsm4-") + 40


def test_a_rank_outside_its_world_is_refused() -> None:
    with pytest.raises(ValidationError):
        KvNamespace(model_id="m", dtype="bfloat16", layout="kv-first", block_tokens=16, tp_rank=2, tp_world_size=2)


def test_a_head_key_names_the_head_and_no_tensor_parallel_rank_or_size() -> None:
    assert head_key(VARIANTS["tp rank"], 7, 3) == head_key(VARIANTS["tp world"], 7, 3) == head_key(BASE, 7, 3)
    assert head_key(BASE, 7, 3) != head_key(BASE, 7, 2)


@pytest.mark.parametrize("part", sorted(set(VARIANTS) - {"tp rank", "tp world"}))
def test_each_shared_part_of_the_namespace_changes_a_head_key(part: str) -> None:
    assert head_key(VARIANTS[part], 7, 0) != head_key(BASE, 7, 0)


def test_a_salt_changes_a_head_key() -> None:
    assert head_key(BASE, 7, 0, "tenant-a") != head_key(BASE, 7, 0)


def test_a_head_key_is_never_a_block_key() -> None:
    """A per-rank value and a per-head value hold different bytes: no key may name both."""
    blocks = {object_key(BASE.model_copy(update={"tp_rank": r, "tp_world_size": 4}), 7, salt)
              for r in range(4) for salt in (None, "s")}
    assert not blocks & {head_key(BASE, 7, head, salt) for head in range(4) for salt in (None, "s")}


def test_the_keys_of_scheme_kvfsm4_and_namespaces_of_kvfsm2_never_change() -> None:
    """Stored values and shared disk directories outlive the process that named them: another process, or a later
    kvfsm, finds them only by the same names. A change of any store key bumps `KEY_PREFIX`, of a namespace name
    `NAMESPACE_PREFIX` (and this test); the digests are those of scheme 2, whose parts schemes 3 and 4 kept."""
    assert object_key(BASE, 7) == "kvfsm4-e5ad19804514c8390d31776a44fddfae8fb36931"
    assert head_key(BASE, 7, 3) == "kvfsm4-89801e7a35c10cc63164b4f6a1542cb5ec6d3858"
    assert namespace_name(BASE) == "kvfsm2-0644c3645991f163d6c0d3400abeba9ad047fec0"
