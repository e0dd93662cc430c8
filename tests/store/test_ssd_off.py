"""The SSD tier turned off (DRAM only): what the pool reports after, and a configure rolled back
after the tier went off."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from messenger.engine import EngineConfig
from store.config import PoolConfig
from store.service import PoolService
from store.ssd import SsdTier
from tests.store.service_support import BB, LAYOUT, held_bytes, put, service


def unwritable(monkeypatch) -> None:
    """The disk refuses every write from now on (a read-only remount, a revoked permission)."""
    def write(self, key, data_, digest):
        raise PermissionError(errno.EACCES, "Permission denied", self.path(key))

    monkeypatch.setattr(SsdTier, "write", write)


def test_the_ssd_skip_counters_stay_reported_with_their_values_once_the_tier_is_off(tmp_path, monkeypatch):
    """They vanished from the stats (hence from /metrics) when the tier went off: a counter a
    scrape saw must not disappear, or rate() and alerts on it break."""
    first = service(tmp_path)
    first.close()
    stray = tmp_path / "ssd" / os.path.basename(first.ssd.root) / "ab"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a block")  # foreign: skipped by the scan, left alone
    s = service(tmp_path)
    try:
        seen = s.stats()["counters"]
        assert (seen["ssd_skipped_foreign"], seen["ssd_skipped_truncated"]) == (1, 0)
        unwritable(monkeypatch)
        for key in range(1, 7):  # DRAM holds 4: the spills fail, the tier goes off
            put(s, [key])
            s.flush()
        stats = s.stats()
        assert not stats["ssd_enabled"] and stats["counters"]["ssd_errors_unwritable"] >= 1
        assert (stats["counters"]["ssd_skipped_foreign"], stats["counters"]["ssd_skipped_truncated"]) == (1, 0)
    finally:
        s.close()


def test_a_configure_rolled_back_after_the_tier_went_off_leaves_a_later_tier_that_can_go_off(tmp_path, monkeypatch,
                                                                                            caplog):
    """The first configure found the SSD directory unusable (the tier off) and then failed (the
    messenger's port taken): rolled back. The next one served the SSD tier, but an "off" flag
    left from the first made its disk faults no-ops: the tier stayed on, every spill failing."""
    blocker = tmp_path / "not-yet"
    blocker.write_text("a file where the SSD directory's parent should be")
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    s = PoolService(PoolConfig(dram_bytes=4 * BB, ssd_dir=str(blocker / "ssd"), ssd_bytes=16 * BB),
                    engine_config=EngineConfig(transports=("tcp",), port=port, checksums=False)).start()
    try:
        with pytest.raises(OSError, match="in use"):
            s.configure(BB, LAYOUT)
        assert s.stats()["counters"]["ssd_errors_unwritable"] == 1
        blocker.unlink()  # the directory can be made now, and the port is free
        taken.close()
        s.configure(BB, LAYOUT)
        assert s.stats()["ssd_enabled"]
        put(s, list(range(1, 5)))
        put(s, [5])  # spills 1
        s.flush()
        assert s.lookup([1]) == ["ssd"] and held_bytes(s, [1]) == [True]
        unwritable(monkeypatch)
        caplog.clear()
        for key in range(6, 10):
            put(s, [key])
            s.flush()
        assert not s.stats()["ssd_enabled"] and s.stats()["usage"]["ssd"]["capacity_bytes"] == 0
        assert "SSD tier off, DRAM only" in caplog.text
        assert s.lookup([1]) == []  # no longer offered from a tier that is off
    finally:
        taken.close()
        s.close()
