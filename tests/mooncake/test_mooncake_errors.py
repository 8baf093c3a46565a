"""Mooncake's negative status codes as named faults: each mapped code its fault, any other `StoreRejected`, and the
message naming what failed and the code's name (or number, for a code Mooncake added since)."""

from __future__ import annotations

import pytest

from kvfsm.mooncake.errors import ChecksumMismatch, KeyMissing, StoreRejected, fault_of


def test_a_known_code_is_its_named_fault_naming_the_call_and_the_code() -> None:
    fault = fault_of(-704, "fetch of k")
    assert type(fault) is KeyMissing and str(fault) == "fetch of k: OBJECT_NOT_FOUND"


def test_a_code_with_no_fault_of_its_own_is_store_rejected_by_name_or_number() -> None:
    named, unknown = fault_of(-1, "removal of k"), fault_of(-12345, "removal of k")
    assert type(named) is StoreRejected and str(named) == "removal of k: INTERNAL_ERROR"
    assert type(unknown) is StoreRejected and str(unknown) == "removal of k: code -12345"


@pytest.mark.parametrize("code, name", [(-600, "INVALID_PARAMS"), (-800, "TRANSFER_FAIL")])
def test_a_size_code_is_a_checksum_fault_of_a_read_and_a_rejection_of_any_other_call(code: int, name: str) -> None:
    read, written = fault_of(code, "fetch of k", read=True), fault_of(code, "write-back of k")
    assert type(read) is ChecksumMismatch and str(read) == f"fetch of k: {name}"
    assert type(written) is StoreRejected and str(written) == f"write-back of k: {name}"
