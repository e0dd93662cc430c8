"""The shm transport's control messages (messenger/shm.py) and their framing on its AF_UNIX socket.

Only control travels here (which slices, where, notifications, acknowledgements); the bytes of
the slices move by cross-memory attach or through shared-memory segments. A frame is a u32
length and a msgpack body, one tagged msgspec struct.

A connection is one-way in who asks: the side that connected sends `Hello`, then `Move`
(followed by its `Sums` when it carries a message), `Where` and `Note` requests; the side that
accepted answers each with one `Ack` or `WhereReply`, in order.
"""

from __future__ import annotations

import socket
import struct

import msgspec

MAX_FRAME_BYTES = 256 << 20  # a corrupt length must not make a reader allocate without bound
_LENGTH = struct.Struct("!I")

# A slice as the initiator described it: (local_region, local_offset, remote_region,
# remote_offset, length), "local" being the initiator's side.
SliceTuple = tuple[str, int, str, int, int]
# Where bytes lie in a segment: (segment name, offset in it).
SpanTuple = tuple[str, int]


class Hello(msgspec.Struct, tag="hello", array_like=True):
    name: str  # the initiator's engine name, what the owner's on_notify is told
    probe_address: int  # where the initiator holds `probe`, for the owner to read by CMA
    probe: bytes
    cma: bool  # whether the initiator allows cross-memory attach at all (ShmConfig.use_cma)


class HelloReply(msgspec.Struct, tag="hello_reply", array_like=True):
    name: str
    cma: bool  # the owner read the probe: it will copy by CMA
    reason: str | None = None  # why not, when not
    probe_address: int = 0  # the owner's own probe, for the initiator to check it may read the owner
    probe: bytes = b""


class Move(msgspec.Struct, tag="move", array_like=True):
    """Slices of one batch. `mode` says who copies and how the owner reaches the initiator's side:
    "cma": the owner copies by process_vm_readv/writev; `addresses` are the initiator's, per slice;
    "mapped": the owner maps the initiator's segments; `spans` are the initiator's, per slice;
    "done": the initiator already copied through the owner's segments; `spans` are the owner's
    memory it used, for the owner to check they still are the slices' regions;
    "pulled": a read the initiator already copied by process_vm_readv (twice as fast as the
    owner's process_vm_writev); `addresses` are the owner's, for it to check the same way."""

    id: int
    write: bool  # initiator -> owner; False: owner -> initiator (a read)
    mode: str
    slices: list[SliceTuple]
    addresses: list[int] = []
    spans: list[SpanTuple] = []
    message: bytes | None = None
    sums_follow: bool = False  # a `Sums` frame follows: the owner copies while they are computed
    # The initiator's time.monotonic() (one clock for every process on a host) at which its batch
    # fails: past it the owner copies nothing, since the initiator may have reused its memory
    # (0: none). A copy already under way at that moment still finishes.
    deadline: float = 0.0


class Sums(msgspec.Struct, tag="sums", array_like=True):
    """The checksums of the `Move` just sent (the engine hashes while the owner copies)."""

    id: int
    checksums: list[int]
    error: str | None = None  # hashing failed: the batch fails


class Where(msgspec.Struct, tag="where", array_like=True):
    """Where the owner's `regions` are: their segments ("done") and addresses ("pulled")."""

    id: int
    regions: list[str]


class WhereReply(msgspec.Struct, tag="where_reply", array_like=True):
    id: int
    spans: list[SpanTuple | None]  # None: private memory, no segment
    error: str | None = None
    bases: list[tuple[int, int]] = []  # (address, length) of each region in the owner


class Note(msgspec.Struct, tag="note", array_like=True):
    """A message without slices (calls and their replies)."""

    id: int
    payload: bytes


class Ack(msgspec.Struct, tag="ack", array_like=True):
    id: int
    error: str | None = None
    checksum: bool = False  # the error is a checksum mismatch (api.ChecksumError)


Request = Hello | Move | Sums | Where | Note
Reply = HelloReply | Ack | WhereReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def send(sock: socket.socket, message: Request | Reply) -> int:
    body = _encoder.encode(message)
    sock.sendall(_LENGTH.pack(len(body)) + body)
    return _LENGTH.size + len(body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> bytes | None:
    prefix = _recv_exactly(sock, _LENGTH.size)
    if prefix is None:
        return None
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"shm control frame of {length} B is too large")
    return _recv_exactly(sock, length)


def recv_request(sock: socket.socket) -> Request | None:
    """The next request, or None when the peer closed. Raises ConnectionError on garbage."""
    body = _recv(sock)
    try:
        return None if body is None else _request_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ConnectionError(f"bad shm control frame: {exc}") from exc


def recv_reply(sock: socket.socket) -> Reply | None:
    body = _recv(sock)
    try:
        return None if body is None else _reply_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ConnectionError(f"bad shm control frame: {exc}") from exc
