"""Frame formats: JSON-header frames (below; tests/spine checks them) and, at the end of this file, the
transfer engine's binary frames (tcp_transport.py).

A frame is a fixed 20-byte prefix, a JSON header and a raw payload:

    magic "MCKV" | version u8 | 3 pad bytes | header length u32 | payload length u64

Headers are small (ids, shapes, checksums); payloads are whole KV blocks copied as they lie in
memory, so the data path never walks tokens in Python. Receivers allocate a new bytearray of the
payload's length for each frame and fill it with recv_into (no intermediate copies, but one
allocation per frame; MAX_PAYLOAD_BYTES bounds it).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

MAGIC = b"MCKV"
VERSION = 1
_PREFIX = struct.Struct("!4sB3xIQ")
PREFIX_SIZE = _PREFIX.size
MAX_HEADER_BYTES = 1 << 20
# A frame larger than this is refused before any allocation: a corrupt length must not make a
# receiver allocate terabytes.
MAX_PAYLOAD_BYTES = 16 << 30


class WireError(ConnectionError):
    """The peer sent something that is not a valid frame, or closed mid-frame."""


def encode_prefix(header_bytes: bytes, payload_len: int) -> bytes:
    return _PREFIX.pack(MAGIC, VERSION, len(header_bytes), payload_len)


def decode_prefix(prefix: bytes) -> tuple[int, int]:
    magic, version, header_len, payload_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: the peer is not a mooncake messenger")
    if version != VERSION:
        raise WireError(f"unsupported frame version {version} (this side speaks {VERSION})")
    if header_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise WireError(f"frame too large: header {header_len} B, payload {payload_len} B")
    return header_len, payload_len


def send_frame(sock: socket.socket, header: dict[str, Any], payload: Any = b"") -> int:
    """Send one frame; returns its size in bytes. `payload` is anything exposing the buffer
    protocol (bytes, numpy, memoryview)."""
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    view = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
    sock.sendall(encode_prefix(header_bytes, view.nbytes) + header_bytes)
    if view.nbytes:
        sock.sendall(view)
    return PREFIX_SIZE + len(header_bytes) + view.nbytes


def recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytearray, int]:
    """Read one frame: (header, payload, the frame's size in bytes). Raises WireError on a
    closed or misbehaving peer."""
    header_len, payload_len = decode_prefix(bytes(recv_exactly(sock, PREFIX_SIZE)))
    try:
        header = json.loads(recv_exactly(sock, header_len))
    except json.JSONDecodeError as exc:
        raise WireError(f"frame header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WireError("frame header is not a JSON object")
    payload = recv_exactly(sock, payload_len) if payload_len else bytearray()
    return header, payload, PREFIX_SIZE + header_len + payload_len


# --- Transfer engine frames (messenger/tcp_transport.py) -----------------------------------------
# A fixed binary prefix, a small variable part (msgpack: segment lists, slice lists, messages) and,
# for data frames, raw bytes that go straight from one registered region into another:
#
#     magic "MCTE" | kind u8 | 3 pad | var length u32 | batch id u64 | arg u64 | payload length u64
#
# Binary rather than JSON because a batch may carry thousands of slices: its per-frame cost must
# stay a struct pack, not a JSON round trip.

ENGINE_MAGIC = b"MCTE"
_ENGINE_PREFIX = struct.Struct("!4sB3xIQQQ")
ENGINE_PREFIX_SIZE = _ENGINE_PREFIX.size
MAX_VAR_BYTES = 64 << 20  # slice lists and messages; a corrupt length must not allocate more


class Kind:
    """Frame kinds of the transfer engine's tcp transport."""

    HELLO = 1  # client -> server, once per connection: who is speaking (engine name, session)
    DATA = 2  # client -> server: bytes for a WRITE batch; var = [[region, offset, length], ...]
    BATCH = 3  # client -> server, before the data: a WRITE batch of `arg` DATA frames; var = slices, message
    ACK = 4  # server -> client: a WRITE batch (or a MSG) landed; var = error text, empty when ok
    READ = 5  # client -> server: send these chunks back; var = [[region, offset, length], ...], arg = first chunk index
    READ_DATA = 6  # server -> client: chunk `arg` of a READ batch, payload = its bytes
    READ_ERR = 7  # server -> client: a READ batch cannot be served; var = error text
    MSG = 8  # client -> server: a message without slices; var = payload
    SUMS = 9  # client -> server, after the data: the batch's checksums (one per slice, maybe none)
    ABORT = 10  # client -> server: the sender gave up on a WRITE batch (timed out); its frames stop


def encode_engine_prefix(kind: int, batch: int, arg: int, var: bytes, payload_len: int) -> bytes:
    return _ENGINE_PREFIX.pack(ENGINE_MAGIC, kind, len(var), batch, arg, payload_len) + var


def decode_engine_prefix(prefix: bytes | bytearray) -> tuple[int, int, int, int, int]:
    """(kind, var length, batch id, arg, payload length); raises WireError on a foreign frame."""
    magic, kind, var_len, batch, arg, payload_len = _ENGINE_PREFIX.unpack(prefix)
    if magic != ENGINE_MAGIC:
        raise WireError(f"bad magic {magic!r}: the peer is not a mooncake transfer engine")
    if var_len > MAX_VAR_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise WireError(f"frame too large: var {var_len} B, payload {payload_len} B")
    return kind, var_len, batch, arg, payload_len


IOV_MAX = 1024  # Linux's UIO_MAXIOV: the most buffers one sendmsg/recvmsg or process_vm_* call takes


def recv_into_views(sock: socket.socket, views: list[memoryview]) -> int:
    """Fill `views` in order straight from the socket (scatter, no intermediate buffer); returns
    the bytes read. Raises WireError if the peer closes first."""
    total = sum(v.nbytes for v in views)
    if len(views) == 1:
        view, got = views[0], 0
        while got < total:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise WireError(f"peer closed the connection after {got} of {total} bytes")
            got += k
        return total
    pending, got = [v for v in views if v.nbytes], 0
    while pending:
        k = sock.recvmsg_into(pending[:IOV_MAX])[0]
        if k == 0:
            raise WireError(f"peer closed the connection after {got} of {total} bytes")
        got += k
        pending = _advance(pending, k)
    return total


def send_views(sock: socket.socket, views: list) -> int:
    """Send every buffer in `views` back to back (gather, no concatenation); returns the bytes sent."""
    pending = [memoryview(v).cast("B") for v in views]
    pending = [v for v in pending if v.nbytes]
    total = sum(v.nbytes for v in pending)
    while pending:
        if len(pending) == 1:
            sock.sendall(pending[0])
            break
        pending = _advance(pending, sock.sendmsg(pending[:IOV_MAX]))
    return total


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first `n` bytes of a list of views."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    rest = views[i:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest
