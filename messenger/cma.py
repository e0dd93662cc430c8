"""Cross-memory attach: copy between this process and another one on the same host in one step.

`process_vm_readv` / `process_vm_writev` (Linux >= 3.2, through ctypes on libc) copy straight
between two address spaces, with no segment and no intermediate buffer: one copy from any
memory of one process (a numpy array, a CPU tensor vLLM allocated) to any memory of another.
The kernel allows it when the caller may ptrace the target (same uid and Yama's ptrace_scope
0, or CAP_SYS_PTRACE); `probe` tells whether it may, per target, before anyone relies on it.

A batch of copies is cut into calls of at most IOV_MAX iovecs (one syscall moves many slices)
and, when it is large, into parts of about equal bytes that run on several threads, since one
core's memory bandwidth is less than the machine's. ctypes releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np

from messenger.wire import IOV_MAX  # noqa: F401 - Linux's UIO_MAXIOV, per side of a call here too

# (local address, remote address, length): one contiguous copy; which way it goes is the call's.
Copy = tuple[int, int, int]


class CmaError(OSError):
    """A cross-memory copy failed (no permission, the target exited, an address not mapped)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_IOVEC_P = ctypes.POINTER(_Iovec)


def _bind(name: str) -> Callable | None:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, name, None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, _IOVEC_P, ctypes.c_ulong, _IOVEC_P, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_READV = _bind("process_vm_readv")  # immutable after import: bound C functions, not state
_WRITEV = _bind("process_vm_writev")


def supported() -> str | None:
    """None when this libc has the calls; otherwise why not."""
    if _READV is None or _WRITEV is None:
        return "libc has no process_vm_readv/process_vm_writev (not Linux, or a libc too old)"
    return None


def _call(fn: Callable, pid: int, copies: Sequence[Copy]) -> None:
    """One batch of at most IOV_MAX copies, retried from where a partial transfer stopped. The
    iovec arrays are built with numpy: a ctypes array of 1024 structs costs a millisecond."""
    table = np.array(copies, dtype=np.int64).reshape(-1, 3)  # user-space addresses fit in int64
    while len(table):
        n = len(table)
        local = np.ascontiguousarray(table[:, [0, 2]])  # (iov_base, iov_len) pairs, as struct iovec
        remote = np.ascontiguousarray(table[:, [1, 2]])
        done = fn(pid, local.ctypes.data_as(_IOVEC_P), n, remote.ctypes.data_as(_IOVEC_P), n, 0)
        if done < 0:
            err = ctypes.get_errno()
            raise CmaError(err, f"{fn.__name__} of pid {pid}: {os.strerror(err)}")
        if done == 0:  # nothing moved and no error: an unmapped address at the start of an iovec
            raise CmaError(errno.EFAULT, f"{fn.__name__} of pid {pid} moved nothing")
        # A partial transfer stops at an iovec boundary or inside one: skip what moved.
        ends = np.cumsum(table[:, 2])
        whole = int(np.searchsorted(ends, done, side="right"))
        rest = done - (int(ends[whole - 1]) if whole else 0)
        table = table[whole:]
        if rest and len(table):
            table[0] += (rest, rest, -rest)


def _run(fn: Callable, pid: int, copies: Sequence[Copy]) -> None:
    for start in range(0, len(copies), IOV_MAX):
        _call(fn, pid, copies[start:start + IOV_MAX])


def split(copies: Sequence[Copy], parts: int) -> list[list[Copy]]:
    """Cut `copies` into at most `parts` lists of about equal bytes, cutting inside a copy when
    one is larger than a share (a single 16 MiB slice still runs on every thread)."""
    total = sum(c[2] for c in copies)
    if parts <= 1 or total == 0:
        return [list(copies)]
    share = -(-total // parts)
    out: list[list[Copy]] = [[]]
    room = share
    for loc, rem, length in copies:
        while length:
            if room == 0:
                out.append([])
                room = share
            take = min(length, room)
            out[-1].append((loc, rem, take))
            loc, rem, length, room = loc + take, rem + take, length - take, room - take
    return out


def in_parallel(run: Callable[[list[Copy]], None], copies: Sequence[Copy], *, pool: Executor | None,
                threads: int, parallel_min_bytes: int) -> None:
    """`run` over `copies`, cut into up to `threads` parts of at least half `parallel_min_bytes`
    each when the batch holds at least `parallel_min_bytes` (this thread runs one part, `pool`
    the others); below that, everything in this thread, where a hand-off would cost more."""
    total = sum(c[2] for c in copies)
    parts = min(threads, total // max(1, parallel_min_bytes // 2))
    if pool is None or total < parallel_min_bytes or parts <= 1:
        run(list(copies))
        return
    chunks = split(copies, parts)
    futures = [pool.submit(run, chunk) for chunk in chunks[1:]]
    error: BaseException | None = None
    try:
        run(chunks[0])
    except BaseException as exc:  # still wait for the others: they use memory the caller owns
        error = exc
    for future in futures:
        try:
            future.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


def transfer(pid: int, copies: Sequence[Copy], *, write: bool, pool: Executor | None = None,
             threads: int = 1, parallel_min_bytes: int = 4 << 20) -> None:
    """Copy local->remote (`write`) or remote->local between this process and `pid`, large
    batches on several threads (`in_parallel`). Raises CmaError."""
    fn = _WRITEV if write else _READV
    if fn is None:
        raise CmaError(errno.ENOSYS, supported() or "")
    in_parallel(lambda chunk: _run(fn, pid, chunk), copies, pool=pool, threads=threads,
                parallel_min_bytes=parallel_min_bytes)


def memmove(copies: Sequence[Copy], *, write: bool) -> None:
    """The same copies between two addresses of this process (a peer's segment mapped here):
    local->remote when `write`. ctypes.memmove releases the GIL."""
    for local, remote, length in copies:
        if write:
            ctypes.memmove(remote, local, length)
        else:
            ctypes.memmove(local, remote, length)


PR_SET_PTRACER = 0x59616D61  # prctl option of the Yama LSM ("Yama")
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def allow_any_ptracer() -> bool:
    """Let any process of this uid attach to this one under Yama's ptrace_scope 1, where
    otherwise only an ancestor may (and a prefill and a decode worker are siblings). No effect
    under scope 0 (any same-uid process may already) or 2-3 (admin only). False when there is
    no Yama to ask."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0) == 0


def probe(pid: int, address: int, expected: bytes) -> str | None:
    """None when `pid`'s memory at `address` can be read and holds `expected` (so `pid` is the
    process that published it, not a stranger with a reused pid or from another pid namespace);
    otherwise why cross-memory attach cannot be used with it."""
    if supported() is not None:
        return supported()
    got = ctypes.create_string_buffer(len(expected))
    try:
        _run(_READV, pid, [(ctypes.addressof(got), address, len(expected))])
    except CmaError as exc:
        return f"process_vm_readv of pid {pid} refused: {exc.strerror} (ptrace_scope, another uid, or seccomp)"
    if got.raw != expected:
        return f"pid {pid} is not the peer (its probe bytes differ: another pid namespace?)"
    return None
