"""The rdma transport's control channel: one TCP connection beside each RC queue pair.

RDMA moves the bytes; this channel carries what the bytes need around them, all small:

    initiator -> target   Connect(name, endpoint, wanted)  target creates a QP for it, answers
    target -> initiator   Connected(endpoint, regions, missing)   both move their QPs to RTS
    initiator -> target   RegionsWanted(names)             a slice names a region not yet known
    target -> initiator   Regions(regions, missing)
    initiator -> target   Notice(seq, slices, payload, checksums)   what batch `seq` wrote
    target -> initiator   Ack(seq, error)                  after it verified batch `seq`
    either way            Message(payload)                 calls and replies (no slices)

The batch itself lands by RDMA WRITE; its last WRITE carries `seq` as immediate data, so the
target learns it landed from its receive queue (RC orders every earlier WRITE before it). The
Notice may arrive before or after that completion; `InboundBook` pairs the two. Frames are a
u32 length and a msgpack body (msgspec, tagged union). With an auth key the connection first
runs messenger/handshake.py.
"""

from __future__ import annotations

import socket
import struct
import threading

import msgspec

from messenger.api import TransferError
from messenger.rdma_plan import QpEndpoint, RemoteRegion

MAX_FRAME_BYTES = 64 << 20  # a Notice of a million slices fits; a corrupt length is refused
_LENGTH = struct.Struct("!I")


class Connect(msgspec.Struct, tag=True):
    name: str  # the initiating engine's name, as its on_notify sees it on the far side
    endpoint: QpEndpoint
    wanted: list[str]  # regions the initiator is about to write or read (saves a round trip)


class Connected(msgspec.Struct, tag=True):
    endpoint: QpEndpoint
    regions: list[RemoteRegion]
    missing: list[str]  # wanted but not registered there


class RegionsWanted(msgspec.Struct, tag=True):
    names: list[str]


class Regions(msgspec.Struct, tag=True):
    regions: list[RemoteRegion]
    missing: list[str]


class Notice(msgspec.Struct, tag=True):
    seq: int
    # (local_region, local_offset, remote_region, remote_offset, length) as the sender wrote them
    slices: list[tuple[str, int, str, int, int]]
    payload: bytes
    checksums: list[int]


class Ack(msgspec.Struct, tag=True):
    seq: int
    error: str | None


class Message(msgspec.Struct, tag=True):
    payload: bytes


Frame = Connect | Connected | RegionsWanted | Regions | Notice | Ack | Message
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


class ControlChannel:
    """One control connection: framed sends from any thread, receives on the owner's thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, frame: Frame) -> None:
        body = _encoder.encode(frame)
        with self._send_lock:
            self.sock.sendall(_LENGTH.pack(len(body)) + body)

    def receive(self) -> Frame:
        """The next frame. Raises TransferError when the peer closed or sent garbage."""
        (length,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        if length > MAX_FRAME_BYTES:
            raise TransferError(f"rdma control frame of {length} B refused (limit {MAX_FRAME_BYTES})")
        try:
            return _decoder.decode(self._exactly(length))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransferError(f"bad rdma control frame: {exc}") from exc

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except OSError as exc:
                raise TransferError(f"rdma control connection lost: {exc}") from exc
            if k == 0:
                raise TransferError("rdma control connection closed by the peer")
            got += k
        return bytes(buf)


class InboundBook:
    """Pairs a Notice with the WRITE-with-immediate that says its batch landed (thread-safe).

    Either may come first: the Notice travels by TCP, the immediate by the queue pair. A batch
    is ready for verification when both are here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notices: dict[int, Notice] = {}
        self._landed: set[int] = set()

    def notice(self, notice: Notice) -> Notice | None:
        with self._lock:
            if notice.seq in self._landed:
                self._landed.discard(notice.seq)
                return notice
            self._notices[notice.seq] = notice
            return None

    def landed(self, seq: int) -> Notice | None:
        with self._lock:
            notice = self._notices.pop(seq, None)
            if notice is None:
                self._landed.add(seq)
            return notice

    def pending(self) -> int:
        with self._lock:
            return len(self._notices) + len(self._landed)
