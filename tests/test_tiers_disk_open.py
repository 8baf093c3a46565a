"""Opening a disk tier: the room check counts the blocks the directory already holds, a failed open is a clear
`DiskTierError` that leaves a shared directory it did not create as it was (and removes one it did), and a shared
tier logs what it found. These are the open path's rules that the tier's I/O tests never reach."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvfsm.machines import default_machines
from kvfsm.tiers.disk import DiskTier, DiskTierError
from kvfsm.tiers.io import ManualIo
from test_tiers_disk_shared import BLOCK, _tier, _write

SLOTS = 8
HELD = 3


def _with_blocks(tmp_path: Path) -> tuple[Path, int]:
    """A shared directory holding `HELD` whole blocks; its path and the bytes one block file takes."""
    tier = _tier(tmp_path, SLOTS)
    _write(tier, range(HELD))
    directory, file_bytes = tier.directory, tier.files.file_bytes
    tier.close()
    return directory, file_bytes


def _free_bytes(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """The disk reports `free` bytes free, whatever it holds."""
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: SimpleNamespace(free=free))


def test_the_room_check_counts_the_blocks_the_directory_already_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, file_bytes = _with_blocks(tmp_path)
    _free_bytes(monkeypatch, (SLOTS - HELD) * file_bytes)  # exactly the room the blocks not held yet need
    again = _tier(tmp_path, SLOTS)
    assert len(again.found.keys) == HELD
    again.close()


def test_a_shared_tier_without_room_is_a_clear_error_that_keeps_the_blocks_it_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory, file_bytes = _with_blocks(tmp_path)
    before = sorted(os.listdir(directory))
    _free_bytes(monkeypatch, (SLOTS - HELD) * file_bytes - 1)
    with pytest.raises(DiskTierError) as refused:
        _tier(tmp_path, SLOTS)
    wanted = SLOTS * file_bytes
    assert str(refused.value) == (f"disk tier 'disk': cannot hold {SLOTS} blocks of {BLOCK} bytes in {directory}: "
                                  f"{os.strerror(errno.ENOSPC)} for {wanted} bytes")
    assert isinstance(refused.value.__cause__, OSError) and refused.value.__cause__.errno == errno.ENOSPC
    assert sorted(os.listdir(directory)) == before  # another engine's blocks: not this failed open's to remove


def test_a_shared_tier_that_cannot_open_removes_the_directory_it_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _free_bytes(monkeypatch, 0)
    with pytest.raises(DiskTierError, match="cannot hold"):
        _tier(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_tier_opens_under_a_path_not_made_yet(tmp_path: Path) -> None:
    tier = DiskTier("disk", tmp_path / "not" / "yet", BLOCK, BLOCK, ManualIo(), machines=default_machines())
    assert tier.directory.is_dir()
    tier.close()


def test_a_directory_that_cannot_be_made_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(DiskTierError, match="cannot hold 1 blocks"):
        DiskTier("disk", tmp_path / "a-file", BLOCK, BLOCK, ManualIo(), machines=default_machines())


def test_a_capacity_under_one_block_is_refused_with_its_figures(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError) as refused:
        DiskTier("disk", tmp_path, BLOCK - 1, BLOCK, ManualIo(), machines=default_machines())
    assert str(refused.value) == f"disk tier 'disk': capacity_bytes={BLOCK - 1} holds no block of {BLOCK}"


def test_a_shared_tier_logs_what_it_found_at_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory, _ = _with_blocks(tmp_path)
    with caplog.at_level(logging.INFO, logger="kvfsm.tiers.disk"):
        _tier(tmp_path, SLOTS).close()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvfsm.tiers.disk"]
    opened = re.fullmatch(rf"disk tier 'disk': {HELD} blocks in {re.escape(str(directory))}, "
                          r"0 torn and 0 over capacity removed, in (\d+\.\d{3}) s", line)
    assert opened and float(opened[1]) < 60
