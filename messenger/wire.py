"""The frame format every messenger transport speaks.

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
