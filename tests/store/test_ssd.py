"""The SSD tier's files: headers, restart scan, truncated/foreign files, corruption."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from store.pool import checksum
from store.ssd import HEADER, SpillWriter, SsdTier

BB = 4096


def block(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, BB, dtype=np.uint8).tobytes()


def tier(tmp_path, layout="model-a") -> SsdTier:
    t = SsdTier(str(tmp_path), layout, BB)
    t.open()
    return t


def test_write_read_roundtrip_and_scan(tmp_path):
    t = tier(tmp_path)
    data = {1: block(1), 2**127 + 5: block(5)}  # keys are 128-bit
    for key, value in data.items():
        t.write(key, value, checksum(value))
    out = bytearray(BB)
    assert t.read_into(2**127 + 5, out, checksum(data[2**127 + 5]))
    assert bytes(out) == data[2**127 + 5]
    t.close()  # the pool ends, and lets the directory go
    found = {b.key: b.checksum for b in tier(tmp_path).scan()}  # a new process: rebuilt from headers
    assert found == {key: checksum(value) for key, value in data.items()}
    assert os.path.getsize(t.path(1)) == HEADER.size + BB


def test_missing_wrong_checksum_and_corrupt_data_are_misses(tmp_path):
    t = tier(tmp_path)
    data = block(1)
    t.write(7, data, checksum(data))
    out = bytearray(BB)
    assert not t.read_into(8, out, 0)  # no file
    assert not t.read_into(7, out, checksum(data) ^ 1)  # the index expects another block
    with open(t.path(7), "r+b") as f:  # one flipped byte in the data
        f.seek(HEADER.size + 100)
        byte = f.read(1)
        f.seek(HEADER.size + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert not t.read_into(7, out, checksum(data))


def test_truncated_foreign_and_other_layout_files_are_skipped_with_a_warning(tmp_path, caplog):
    t = tier(tmp_path)
    for key in (1, 2, 3):
        t.write(key, block(key), checksum(block(key)))
    with open(t.path(1), "r+b") as f:  # a write cut short
        f.truncate(HEADER.size + 10)
    foreign = os.path.join(t.root, "ab", "notes.txt")
    os.makedirs(os.path.dirname(foreign), exist_ok=True)
    with open(foreign, "wb") as f:
        f.write(b"somebody else's file")
    renamed = t.path(99)  # a valid block under the wrong name
    os.makedirs(os.path.dirname(renamed), exist_ok=True)
    os.rename(t.path(3), renamed)
    with open(t.path(4) + ".123.tmp", "wb") as f:
        os.makedirs(os.path.dirname(t.path(4)), exist_ok=True)
    os.mkfifo(os.path.join(t.root, "ab", "a-fifo"))  # opening it would block the start-up
    os.symlink(t.path(2), t.path(5))  # a link to a block, under another block's name
    t.close()
    with caplog.at_level(logging.WARNING):
        found = tier(tmp_path).scan()
    assert [b.key for b in found] == [2]
    assert "truncated" in caplog.text and "foreign" in caplog.text and "not a regular file" in caplog.text
    assert not os.path.exists(t.path(1))  # ours and broken: deleted
    assert os.path.exists(foreign)  # not ours: left alone
    assert tier(tmp_path, layout="model-b").scan() == []  # another layout sees none of them


def test_a_block_file_moved_out_of_its_place_and_foreign_tmp_files_are_left_alone(tmp_path, caplog):
    """A valid block anywhere but path(key) was restored and advertised, yet no read finds it; a
    *.tmp not of the writer's own naming was deleted as ours."""
    t = tier(tmp_path)
    t.write(7, block(7), checksum(block(7)))
    moved = os.path.join(t.root, os.path.basename(t.path(7)))  # the layout's root, not its key's folder
    os.rename(t.path(7), moved)
    theirs = os.path.join(t.root, "download.tmp")
    with open(theirs, "wb") as f:
        f.write(b"x")
    ours = t.path(8) + ".4242.tmp"
    os.makedirs(os.path.dirname(ours), exist_ok=True)
    with open(ours, "wb") as f:
        f.write(b"half a block")
    t.close()
    with caplog.at_level(logging.WARNING):
        assert tier(tmp_path).scan() == []
    assert "foreign" in caplog.text
    assert os.path.exists(moved) and os.path.exists(theirs) and not os.path.exists(ours)


def test_a_directory_that_cannot_be_made_raises_oserror(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OSError):
        SsdTier(str(tmp_path / "file" / "pool"), "x", BB).open()


def test_spill_writer_reports_each_write_and_drops_beyond_its_budget(tmp_path):
    t = tier(tmp_path)
    results = []
    writer = SpillWriter(t, lambda key, error: results.append((key, error)), max_queued_bytes=BB)
    try:
        assert writer.submit(1, block(1), checksum(block(1)))
        writer.flush()
        assert results == [(1, None)]
        assert not writer.submit(2, block(2) + b"x", 0)  # larger than the budget
    finally:
        writer.close()


def test_the_tiers_own_files_are_not_foreign_and_an_empty_block_file_is_deleted(tmp_path, caplog):
    """The scan counted the tier's own .lock as a foreign file on every start (the metric and the
    warning were never clean), and called a block file cut to under 8 bytes foreign too, so it
    stayed on disk and was warned about on every start."""
    t = tier(tmp_path)
    t.write(1, block(1), checksum(block(1)))
    empty = t.path(2)
    os.makedirs(os.path.dirname(empty), exist_ok=True)
    open(empty, "wb").close()  # a power loss between the rename and the data
    short = t.path(3)
    os.makedirs(os.path.dirname(short), exist_ok=True)
    with open(short, "wb") as f:
        f.write(b"MO")
    t.close()
    fresh = tier(tmp_path)
    with caplog.at_level(logging.WARNING):
        found = fresh.scan()
    assert [b.key for b in found] == [1]
    assert fresh.skipped["foreign"] == 0 and fresh.skipped["truncated"] == 2 and "foreign" not in caplog.text
    assert not os.path.exists(empty) and not os.path.exists(short)


def test_pools_sharing_a_disk_each_have_room_for_their_share_of_its_free_space(tmp_path, monkeypatch):
    """Each of serve's workers saw the whole free space at start: N of them claimed it N times."""
    t = tier(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: type("St", (), {"f_bavail": 100, "f_frsize": t.file_bytes})())
    assert t.room_for_files() == 90  # a tenth of the free space is left to others
    assert [t.room_for_files(n) for n in (3, 4)] == [30, 22]
