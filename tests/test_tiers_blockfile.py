"""One namespace's block files: a write is a temporary file of its key until renamed whole, a read names what is
wrong with a file that fails its check, and the scan at open counts exactly what it removed and leaves alone what
is not a block's."""

from __future__ import annotations

import errno
import os
import re
import time
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from kvfsm.tiers import blockfile
from kvfsm.tiers.blockfile import MAGIC, RECORD, TEMPORARY, BlockFiles, CorruptBlock, DiskIo
from test_tiers_disk_shared import BLOCK, MODEL

KEY = 0x2A


def _files(directory: Path, disk: DiskIo | None = None) -> BlockFiles:
    return BlockFiles(directory, MODEL, BLOCK, disk or DiskIo())


def _block(key: int) -> memoryview:
    return memoryview(np.random.default_rng(key).integers(0, 256, BLOCK, dtype=np.uint8))


def _corrupt(files: BlockFiles, key: int) -> CorruptBlock:
    with pytest.raises(CorruptBlock) as failed:
        files.read(key, memoryview(np.zeros(BLOCK, dtype=np.uint8)))
    return failed.value


class _Watching(DiskIo):
    """Lists the directory while the block's bytes are being written."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.seen = directory, []  # type: list[str]

    def write(self, fd: int, parts: Sequence[memoryview]) -> None:
        self.seen = os.listdir(self.directory)
        super().write(fd, parts)


def test_a_block_being_written_is_a_temporary_file_of_its_key_in_the_directory(tmp_path: Path) -> None:
    disk = _Watching(tmp_path)
    _files(tmp_path, disk).write(KEY, _block(KEY))
    assert len(disk.seen) == 1 and re.fullmatch(rf"\.{KEY:x}-.+{re.escape(TEMPORARY)}", disk.seen[0])
    assert os.listdir(tmp_path) == [f"{KEY:x}.kv"]


def test_a_short_write_continues_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write, calls = os.write, []

    def short(fd: int, data: memoryview) -> int:
        calls.append(fd)
        assert len(calls) < 100, "the write never finishes"
        return write(fd, bytes(data[:1000]))

    monkeypatch.setattr(os, "write", short)
    files = _files(tmp_path)
    files.write(KEY, _block(KEY))
    assert files.payload(KEY) == bytes(_block(KEY))


def test_a_failed_read_names_its_file_and_what_is_wrong_with_it(tmp_path: Path) -> None:
    files = _files(tmp_path)
    files.write(KEY, _block(KEY), carried=zlib.crc32(_block(KEY)) ^ 1)  # bytes changed since their CPU store
    mismatch = _corrupt(files, KEY)
    assert (mismatch.errno, mismatch.strerror) == (errno.EIO, f"{KEY:x}.kv: checksum mismatch")
    files.write(KEY + 1, _block(KEY))
    os.rename(files.path(KEY + 1), files.path(KEY))
    assert _corrupt(files, KEY).strerror == f"{KEY:x}.kv: names another block or namespace"
    files.write(KEY, _block(KEY))
    with open(files.path(KEY), "r+b") as file:
        file.write(b"notmagic")
    assert _corrupt(files, KEY).strerror == (f"{KEY:x}.kv: record b'notmagic' of {BLOCK} bytes, "
                                             f"expected {MAGIC!r} of {BLOCK}")


def test_removing_a_block_another_engine_removed_first_is_no_error(tmp_path: Path) -> None:
    _files(tmp_path).remove(KEY)


def test_the_scan_counts_each_file_it_removed_and_leaves_other_files_alone(tmp_path: Path) -> None:
    files = _files(tmp_path)
    for key in range(4):
        files.write(key, _block(key))
    for name in ("a" + TEMPORARY, "b" + TEMPORARY):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "7.kv").write_bytes(bytes(RECORD.size))  # a block file of a wrong size
    (tmp_path / "notes.txt").write_bytes(bytes(files.file_bytes))  # not a block's, though of a block's size
    found = files.scan(capacity=1, stale_after_s=-1.0)
    assert (len(found.keys), found.torn, found.over_capacity) == (1, 3, 3)
    assert sorted(os.listdir(tmp_path)) == sorted([files.path(found.keys[0]).name, "notes.txt"])


def test_the_scan_goes_on_past_a_file_removed_since_the_listing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(tmp_path)
    for key in range(3):
        files.write(key, _block(key))
    stat = blockfile._stat
    monkeypatch.setattr(blockfile, "_stat", lambda item: None if item.name == files.path(1).name else stat(item))
    assert sorted(files.scan(capacity=3, stale_after_s=60.0).keys) == [0, 2]


def test_a_temporary_file_exactly_as_old_as_the_deadline_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = 1_000_000.0
    (tmp_path / ("a" + TEMPORARY)).write_bytes(b"")
    os.utime(tmp_path / ("a" + TEMPORARY), (now - 5, now - 5))
    monkeypatch.setattr(time, "time", lambda: now)
    assert _files(tmp_path).scan(capacity=1, stale_after_s=5.0).torn == 0


def test_a_file_another_process_removed_first_is_not_counted(tmp_path: Path) -> None:
    assert BlockFiles._unlink(str(tmp_path / "gone.kv")) == 0
