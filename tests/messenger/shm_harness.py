"""A region table, an inbound handler and a peer process for testing the shm transport on its own,
without the engine (messenger/api.py's RegionTable and InboundHandler, the least that honours them).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from messenger.api import Batch, Direction, OutgoingMessage, PeerInfo, Region, Slice, TransferError
from messenger.segments import SharedBuffer
from messenger.shm import ShmConfig, ShmTransport


class Table:
    """Regions by name, over numpy arrays (or SharedBuffers) the test keeps alive."""

    def __init__(self) -> None:
        self.regions: dict[str, Region] = {}
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, array: np.ndarray) -> np.ndarray:
        flat = array.reshape(-1).view(np.uint8)
        self.arrays[name] = flat
        self.regions[name] = Region(name, flat.nbytes, flat.ctypes.data, memoryview(flat))
        return flat

    def get(self, name: str) -> Region:
        try:
            return self.regions[name]
        except KeyError:
            raise TransferError(f"no region {name!r}") from None


def digest(view) -> str:
    return hashlib.sha256(bytes(view)).hexdigest()


@dataclass
class Inbox:
    """Records what arrived. At notification time it hashes the landed slices, so a test can
    check the bytes were there before the notification, not after."""

    table: Table
    reply: str | None = None  # what slices_landed returns (an error to send back)
    hold_s: float = 0.0  # how long slices_landed blocks (a peer that stops answering)
    landed: list[tuple[str, list[Slice], bytes | None, tuple[int, ...], list[str]]] = field(default_factory=list)
    messages: list[tuple[str, bytes]] = field(default_factory=list)
    failed: list[tuple[str, bytes | None, str]] = field(default_factory=list)
    event: threading.Event = field(default_factory=threading.Event)

    def slices_landed(self, peer: str, slices: list[Slice], message: OutgoingMessage | None) -> str | None:
        seen = [digest(self.table.arrays[s.remote_region][s.remote_offset:s.remote_offset + s.length])
                for s in slices]
        self.landed.append((peer, slices, None if message is None else message.payload,
                            () if message is None else message.checksums, seen))
        self.event.set()
        time.sleep(self.hold_s)
        return self.reply

    def message(self, peer: str, payload: bytes) -> None:
        self.messages.append((peer, payload))
        self.event.set()

    def batch_failed(self, peer: str, message: OutgoingMessage | None, error: str) -> None:
        self.failed.append((peer, None if message is None else message.payload, error))


def peer_info(name: str, descriptor: str, table: Table, host: str = "test-host") -> PeerInfo:
    return PeerInfo(name, host, {"shm": descriptor}, tuple(r.info() for r in table.regions.values()))


def submit(transport: ShmTransport, peer: PeerInfo, direction: Direction, slices: list[Slice],
           message: bytes | None = None, checksums: tuple[int, ...] = ()) -> Batch:
    batch = Batch(sum(s.length for s in slices), len(slices))
    outgoing = None if message is None else OutgoingMessage(message, checksums)
    transport.submit(peer, direction, slices, batch, outgoing)
    return batch


def _serve(conn, name: str, size: int, config: ShmConfig, shared: bool, uid: int | None,
           auth_key: bytes | None) -> None:
    """The peer process: one region "mem" of `size` bytes, commands from the test over `conn`."""
    if uid is not None:
        os.setgid(uid)
        os.setuid(uid)
    table = Table()
    segment = SharedBuffer(size) if shared else None
    mem = table.add("mem", segment.array if segment is not None else np.zeros(size, np.uint8))
    inbox = Inbox(table)
    transport = ShmTransport(EngineLike(auth_key), shm=config, name=name)
    conn.send(transport.start(table, inbox))
    while True:
        command, arg = conn.recv()
        if command == "fill":  # arg: seed
            mem[:] = np.random.default_rng(arg).integers(0, 256, size, dtype=np.uint8)
            conn.send(None)
        elif command == "digest":  # arg: (offset, length)
            conn.send(digest(mem[arg[0]:arg[0] + arg[1]]))
        elif command == "inbox":
            conn.send((inbox.landed, inbox.messages))
        elif command == "failed":
            conn.send(inbox.failed)
        elif command == "set":  # arg: (attribute, value) of the inbox
            setattr(inbox, *arg)
            conn.send(None)
        elif command == "close":
            transport.close()
            conn.send(None)
        elif command == "exit":
            if segment is not None:
                segment.close()
            conn.send(None)
            return


@dataclass(frozen=True)
class EngineLike:
    """The one field of messenger.engine.EngineConfig the shm transport reads."""

    auth_key: bytes | None = None


class PeerProcess:
    """A real second process serving one region through its own ShmTransport."""

    def __init__(self, name: str = "peer", size: int = 1 << 20, config: ShmConfig = ShmConfig(),
                 shared: bool = False, uid: int | None = None, auth_key: bytes | None = None):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, name, size, config, shared, uid, auth_key),
                                   daemon=True)
        self.process.start()
        self.name, self.size = name, size
        if not self._conn.poll(30):
            raise RuntimeError("the shm peer process did not start")
        self.descriptor: str = self._conn.recv()
        self.info = PeerInfo(name, "test-host", {"shm": self.descriptor})

    def __call__(self, command: str, arg=None):
        self._conn.send((command, arg))
        if not self._conn.poll(30):
            raise RuntimeError(f"the shm peer did not answer {command!r}")
        return self._conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self("exit")
            except (OSError, EOFError, RuntimeError):
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.kill()


def _serve_engine(conn, name: str, size: int, transports: tuple[str, ...]) -> None:
    """A peer process around a real TransferEngine with one region "mem" (see EngineProcess)."""
    import msgspec

    from messenger.engine import EngineConfig, TransferEngine

    notes: list[tuple[str, bytes, str | None, str]] = []
    mem = np.zeros(size, np.uint8)

    def on_notify(peer: str, message: bytes, error: str | None) -> None:
        notes.append((peer, message, error, digest(mem)))  # what had landed when it was told

    engine = TransferEngine(name, EngineConfig(transports=transports))
    engine.register("mem", mem)
    info = engine.start(on_notify, lambda peer, request: b"echo:" + request)
    conn.send(msgspec.json.encode(info))
    while True:
        command, arg = conn.recv()
        if command == "add_peer":
            conn.send(engine.add_peer(msgspec.json.decode(arg, type=PeerInfo)))
        elif command == "fill":
            mem[:] = np.random.default_rng(arg).integers(0, 256, size, dtype=np.uint8)
            conn.send(None)
        elif command == "digest":
            conn.send(digest(mem[arg[0]:arg[0] + arg[1]]))
        elif command == "notes":
            conn.send(notes)
        elif command == "stats":
            conn.send(engine.stats())
        elif command == "exit":
            engine.close()
            conn.send(None)
            return


class EngineProcess(PeerProcess):
    """A real second process running a TransferEngine (messenger/engine.py) over `transports`."""

    def __init__(self, name: str = "peer", size: int = 1 << 20, transports: tuple[str, ...] = ("shm",)):
        import msgspec

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve_engine, args=(child, name, size, transports), daemon=True)
        self.process.start()
        self.name, self.size = name, size
        if not self._conn.poll(30):
            raise RuntimeError("the engine peer process did not start")
        self.info = msgspec.json.decode(self._conn.recv(), type=PeerInfo)
        self.descriptor = self.info.transports.get("shm", "")
