"""The shm transport's control connection against what a broken or hostile client may send:
the owner tells its engine about a batch whose sender left, survives garbage, and checks keys."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from messenger import shm_wire
from messenger.api import Direction, Slice, TransferError
from messenger.shm import ShmTransport
from tests.messenger.shm_harness import EngineLike, Inbox, PeerProcess, Table, submit

KEY = b"k" * 32


@pytest.fixture(scope="module")
def peer():
    process = PeerProcess()
    yield process
    process.stop()


def connect(descriptor: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + json.loads(descriptor)["socket"])
    return sock


def local_transport(auth_key: bytes | None = None) -> ShmTransport:
    table = Table()
    table.add("mem", np.zeros(4096, np.uint8))
    transport = ShmTransport(EngineLike(auth_key), name="local")
    transport.start(table, Inbox(table))
    return transport


def test_a_sender_that_leaves_before_its_checksums_is_reported_to_the_engine(peer):
    sock = connect(peer.descriptor)
    shm_wire.send(sock, shm_wire.Hello("leaver", 0, b"x" * 16, False))
    assert isinstance(shm_wire.recv_reply(sock), shm_wire.HelloReply)
    shm_wire.send(sock, shm_wire.Move(1, True, "cma", [("mem", 0, "mem", 0, 64)], addresses=[0],
                                      message=b"layer 0", sums_follow=True))
    sock.close()  # gone before the Sums frame
    deadline = time.monotonic() + 5
    while not (failed := peer("failed")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(name, message) for name, message, _ in failed] == [("leaver", b"layer 0")]


def test_garbage_on_the_socket_closes_that_connection_only(peer):
    sock = connect(peer.descriptor)
    sock.sendall(b"\x00\x00\x00\x05hello")  # a frame that is not msgpack of a Hello
    assert sock.recv(100) == b""  # the owner hung up
    sock.close()
    transport = local_transport()
    try:
        submit(transport, peer.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 64)], b"still here").wait(10)
    finally:
        transport.close()


def test_a_peer_with_a_key_refuses_a_client_without_it_and_accepts_one_with_it():
    process = PeerProcess(auth_key=KEY)
    strangers, friends = local_transport(), local_transport(KEY)
    try:
        with pytest.raises(TransferError, match="cannot connect.*closed the connection during the hello"):
            submit(strangers, process.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 64)], b"x").wait(15)
        submit(friends, process.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 64)], b"x").wait(10)
        assert process("inbox")[0][-1][0] == "local"
    finally:
        strangers.close()
        friends.close()
        process.stop()
