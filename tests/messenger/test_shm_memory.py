"""The shm transport's two ways to memory, on their own: cross-memory attach (messenger/cma.py) and
named segments (messenger/segments.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

import numpy as np
import pytest

from messenger import cma
from messenger.segments import SHM_DIR, PeerSegments, SegmentSpan, SharedBuffer, segment_of


def test_split_cuts_into_parts_of_about_equal_bytes_and_covers_everything_once():
    copies = [(1000, 50_000, 300), (5000, 90_000, 10_000), (40_000, 0, 7)]
    parts = cma.split(copies, 4)
    assert len(parts) == 4
    sizes = [sum(c[2] for c in part) for part in parts]
    assert sum(sizes) == 10_307 and max(sizes) - min(sizes) <= 2_600
    # Every byte of every copy appears exactly once, at matching local and remote offsets.
    pieces = sorted(c for part in parts for c in part)
    rebuilt, expected = [], sorted(copies)
    for loc, rem, length in pieces:
        if rebuilt and rebuilt[-1][0] + rebuilt[-1][2] == loc and rebuilt[-1][1] + rebuilt[-1][2] == rem:
            rebuilt[-1] = (rebuilt[-1][0], rebuilt[-1][1], rebuilt[-1][2] + length)
        else:
            rebuilt.append((loc, rem, length))
    assert rebuilt == expected
    assert cma.split(copies, 1) == [copies]


@pytest.mark.parametrize("write", [True, False])
def test_transfer_moves_more_copies_than_one_call_takes_on_several_threads(write):
    src = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    n = 2500  # > 2 * IOV_MAX
    step = src.nbytes // n
    order = np.random.default_rng(2).permutation(n)
    # local is dst when reading, src when writing; "remote" is this very process.
    local, remote = (src, dst) if write else (dst, src)
    copies = [(local.ctypes.data + int(i) * step, remote.ctypes.data + int(j) * step, step)
              for i, j in zip(range(n), order)]
    with ThreadPoolExecutor(3) as pool:
        cma.transfer(os.getpid(), copies, write=write, pool=pool, threads=4, parallel_min_bytes=1 << 20)
    for i, j in zip(range(n), order):
        a, b = (i, int(j)) if write else (int(j), i)
        assert np.array_equal(dst[b * step:(b + 1) * step], src[a * step:(a + 1) * step])


def test_transfer_to_an_unmapped_address_raises():
    buf = np.zeros(4096, np.uint8)
    with pytest.raises(cma.CmaError):
        cma.transfer(os.getpid(), [(buf.ctypes.data, 8, 4096)], write=False)


def test_a_partial_transfer_goes_on_where_it_stopped_then_reports_the_hole():
    """The kernel stops at the first unmapped byte; what came before it is copied, then the
    retry from there fails: the batch fails, never silently short."""
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert libc.munmap(base + page, page) == 0  # a hole right after the first page
    try:
        ctypes.memset(base, 0x5A, page)
        dst = np.zeros(3 * page, np.uint8)
        copies = [(dst.ctypes.data, base, 100),  # whole
                  (dst.ctypes.data + page, base + page - 300, 600)]  # 300 bytes, then the hole
        with pytest.raises(cma.CmaError):
            cma.transfer(os.getpid(), copies, write=False)
        assert (dst[:100] == 0x5A).all() and (dst[page:page + 300] == 0x5A).all()
        assert not dst[page + 300:].any()
    finally:
        libc.munmap(base, page)


def test_probe_accepts_only_the_process_that_holds_the_bytes():
    token = os.urandom(16)
    buf = np.frombuffer(token, np.uint8).copy()
    assert cma.probe(os.getpid(), buf.ctypes.data, token) is None
    assert "differ" in cma.probe(os.getpid(), buf.ctypes.data, os.urandom(16))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert "refused" in cma.probe(child.pid, buf.ctypes.data, token)  # gone: ESRCH


def test_declaring_any_ptracer_is_harmless_where_there_is_no_yama():
    yama = os.path.exists("/proc/sys/kernel/yama/ptrace_scope")
    assert cma.allow_any_ptracer() is yama  # without Yama the kernel answers EINVAL
    assert cma.probe(os.getpid(), np.frombuffer(b"x" * 16, np.uint8).ctypes.data, b"x" * 16) is None


def test_memmove_copies_both_ways():
    a = np.arange(256, dtype=np.uint8)
    b = np.zeros(256, np.uint8)
    cma.memmove([(a.ctypes.data + 10, b.ctypes.data + 20, 30)], write=True)
    assert np.array_equal(b[20:50], a[10:40]) and not b[:20].any() and not b[50:].any()
    c = np.zeros(256, np.uint8)
    cma.memmove([(c.ctypes.data, b.ctypes.data + 20, 30)], write=False)
    assert np.array_equal(c[:30], a[10:40])


def test_shared_buffer_is_seen_by_whoever_attaches_and_unlinked_on_close():
    with SharedBuffer(1 << 16) as owner:
        owner.array[:5] = [1, 2, 3, 4, 5]
        peer = SharedBuffer.attach(owner.name)
        assert peer.size == 1 << 16 and list(peer.array[:5]) == [1, 2, 3, 4, 5]
        peer.array[100] = 42
        assert owner.array[100] == 42
        peer.close()
        assert os.path.exists(os.path.join(SHM_DIR, owner.name))  # a peer's close does not unlink
    assert not os.path.exists(os.path.join(SHM_DIR, owner.name))
    with pytest.raises(ValueError):
        SharedBuffer(0)


def test_segment_of_finds_segments_from_any_allocator_and_not_private_memory():
    with SharedBuffer(1 << 20) as buf:
        assert segment_of(buf.address + 4096, 100) == SegmentSpan(buf.name, 4096)
        assert segment_of(buf.address + (1 << 20) - 10, 100) is None  # runs past the mapping
    assert segment_of(np.zeros(1 << 20, np.uint8).ctypes.data, 10) is None
    other = shared_memory.SharedMemory(create=True, size=1 << 16)
    try:
        view = np.frombuffer(other.buf, np.uint8)
        assert segment_of(view.ctypes.data + 8, 8) == SegmentSpan(other.name.lstrip("/"), 8)
        other.unlink()  # still mapped, but no peer can open it any more
        assert segment_of(view.ctypes.data + 8, 8) is None
        del view
    finally:
        other.close()


def test_peer_segments_map_once_and_refuse_spans_past_the_end():
    with SharedBuffer(8192) as buf:
        buf.array[:] = 7
        segments = PeerSegments()
        try:
            address = segments.address(SegmentSpan(buf.name, 4096), 4096)
            assert segments.address(SegmentSpan(buf.name, 0), 1) == address - 4096  # the same mapping
            assert np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 4).from_address(address))[0] == 7
            with pytest.raises(ValueError, match="outside segment"):
                segments.address(SegmentSpan(buf.name, 4096), 4097)
            with pytest.raises(FileNotFoundError):
                segments.address(SegmentSpan("mooncake-no-such-segment", 0), 1)
        finally:
            segments.close()
