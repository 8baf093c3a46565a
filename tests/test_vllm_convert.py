"""The adapter's conversions between vLLM's types and kvfsm's (`kvfsm.integrations.vllm.convert`): block hashes and
the workers' metadata, each refusal naming what it got."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm.convert import HashCodec, HashWidthMismatch, KvfsmWorkerMetadata  # noqa: E402

pytestmark = pytest.mark.vllm


def test_a_hash_cannot_be_turned_back_into_bytes_before_any_was_converted() -> None:
    with pytest.raises(HashWidthMismatch, match="^no block hash was converted yet, so the width is unknown$"):
        HashCodec().to_bytes(1)


def test_block_hashes_of_another_width_are_refused_naming_both() -> None:
    codec = HashCodec()
    assert codec.to_int(b"\x00\x01") == 1
    with pytest.raises(HashWidthMismatch, match="^a 3-byte block hash after 2-byte ones$"):
        codec.to_int(b"abc")


def test_worker_metadata_aggregates_every_field_and_refuses_another_connectors_naming_its_type() -> None:
    one = KvfsmWorkerMetadata((), (("disk", 1),), (("disk", 0, None),))  # type: ignore[arg-type]
    two = KvfsmWorkerMetadata((), (("disk", 2),), (("disk", 1, None),))  # type: ignore[arg-type]
    both = one.aggregate(two)
    assert (both.evicted, both.namespaces) == ((("disk", 1), ("disk", 2)), (("disk", 0, None), ("disk", 1, None)))
    with pytest.raises(TypeError, match="^cannot aggregate kvfsm worker metadata with object$"):
        one.aggregate(object())  # type: ignore[arg-type]
