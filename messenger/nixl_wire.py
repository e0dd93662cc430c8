"""What nixl transports tell each other in NIXL notifications (messenger/nixl_transport.py's
docstring says when each is sent): a peer's address in PeerInfo, the regions asked for and their
keys, a WRITE batch's notice and its acknowledgement, and plain messages (calls and replies)."""

from __future__ import annotations

import msgspec


class Address(msgspec.Struct, frozen=True):
    agent: str
    metadata: str  # base64 of nixl_agent.get_agent_metadata()


class Want(msgspec.Struct, tag=True):
    sender: str
    metadata: bytes
    names: list[str]


class Regions(msgspec.Struct, tag=True):  # answers carry no engine name: the initiator knows the agent
    metadata: list[bytes]  # partial metadata (one per memory kind): the keys of the regions below
    regions: list[tuple[str, int, int, str, int]]  # name, address, length, memory kind (DRAM/VRAM), device id
    missing: list[str]


class Notice(msgspec.Struct, tag=True):
    sender: str
    seq: int
    slices: list[tuple[str, int, str, int, int]]
    payload: bytes
    checksums: list[int]


class Ack(msgspec.Struct, tag=True):
    seq: int
    error: str | None


class Message(msgspec.Struct, tag=True):
    sender: str
    payload: bytes


Notification = Want | Regions | Notice | Ack | Message
encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(Notification).decode
