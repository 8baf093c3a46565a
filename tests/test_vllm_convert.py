"""The adapter's conversions between vLLM's types and kvfsm's (`kvfsm.integrations.vllm.convert`): block hashes and
the workers' metadata, each refusal naming what it got; the block tables kept from vLLM's scheduler outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402

from kvfsm.integrations.vllm.convert import BlockTables, HashCodec, HashWidthMismatch, KvfsmWorkerMetadata  # noqa: E402

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


def _step(new: dict[str, list[int]] | None = None, finished: frozenset[str] = frozenset(),
          preempted: set[str] | None = None) -> SchedulerOutput:
    """A scheduler output of only what `BlockTables` reads: new requests' blocks, finished and preempted ids."""
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [SimpleNamespace(req_id=r, block_ids=(blocks,)) for r, blocks in (new or {}).items()]
    output.finished_req_ids = set(finished)
    output.preempted_req_ids = preempted
    return output


@pytest.mark.parametrize("ended", ["finished", "preempted"])
def test_a_finished_or_preempted_requests_block_table_is_dropped(ended: str) -> None:
    tables = BlockTables()
    tables.update(_step(new={"a": [1, 2], "b": [3]}))
    tables.update(_step(**{ended: {"a"}}))
    assert tables["b"] == (3,)
    with pytest.raises(KeyError):
        tables["a"]


def test_a_request_finished_before_it_got_a_block_table_is_passed_over() -> None:
    """vLLM finishes a request aborted while waiting, which never had blocks scheduled."""
    tables = BlockTables()
    tables.update(_step(new={"b": [3]}))
    tables.update(_step(finished={"never-scheduled"}))
    assert tables["b"] == (3,)
