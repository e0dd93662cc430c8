"""A stand-in for `messenger.engine.TransferEngine` over the old request/reply `messenger/tcp.py`,
used only until the transfer engine lands (helper msg-engine); then this file goes.

It implements the subset of the engine's decided surface the KV path uses (register, start with
on_notify/on_call, info, add_peer, write, call, stats, close) with the engine's promises:
a message rides after its batch's slices landed and passed an xxh3-64 check per slice; a failed
slice fails the batch on both sides. It is not zero-copy (the sender gathers slices into one
frame) and sends one batch at a time per peer; the real engine replaces both.
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import xxhash

from messenger.api import (Batch, CallHandler, ChecksumError, NotifyHandler, PeerInfo, Region, Slice,
                           TransferError)
from messenger.stats import TransportStats
from messenger.tcp import TcpClient, TcpConfig, TcpServer
from messenger.tcp import TransferError as TcpTransferError

log = logging.getLogger("vllm.mooncake." + __name__)


class ShimEngine:
    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0, auth_key: bytes | None = None,
                 timeout_s: float = 10.0):
        self.name = name
        self._config = TcpConfig(auth_key=auth_key, io_timeout_s=timeout_s, connect_timeout_s=min(5.0, timeout_s))
        self._stats = TransportStats()
        self._regions: dict[str, Region] = {}
        self._server = TcpServer(host, port, self._on_frame, self._config, self._stats)
        self._client = TcpClient(self._config, self._stats)
        self._peers: dict[str, PeerInfo] = {}
        self._senders: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._on_notify: NotifyHandler | None = None
        self._on_call: CallHandler | None = None
        # Test-only fault hook (off by default): flip one byte of the next N slices after their
        # checksum was taken, as a bad wire would. Set by the KV sender's own hook.
        self.flip_next_slices = 0

    def register(self, name: str, buffer) -> Region:
        view = memoryview(buffer).cast("B")
        region = Region(name=name, length=view.nbytes, address=0, view=view)
        self._regions[name] = region
        return region

    def unregister(self, name: str) -> None:
        self._regions.pop(name, None)

    def start(self, on_notify: NotifyHandler | None = None, on_call: CallHandler | None = None) -> PeerInfo:
        self._on_notify, self._on_call = on_notify, on_call
        self._server.start()
        return self.info()

    def info(self) -> PeerInfo:
        return PeerInfo(self.name, socket.gethostname(), {"tcp": self._server.address},
                        tuple(r.info() for r in self._regions.values()))

    def add_peer(self, peer: PeerInfo) -> str:
        with self._lock:
            self._peers[peer.name] = peer
            self._senders.setdefault(peer.name, ThreadPoolExecutor(1, thread_name_prefix="kv-shim-send"))
        return "tcp"

    def write(self, peer: str, slices: list[Slice], message: bytes | None = None) -> Batch:
        batch = Batch(sum(s.length for s in slices), len(slices))
        self._senders[peer].submit(self._send, peer, slices, message, batch)
        return batch

    def call(self, peer: str, request: bytes, timeout_s: float | None = None) -> bytes:
        header = {"op": "call", "from": self.name, "body": base64.b64encode(request).decode()}
        try:
            reply = self._client.request(self._peers[peer].transports["tcp"], header)
        except TcpTransferError as exc:
            raise TransferError(str(exc)) from exc
        return base64.b64decode(reply["body"])

    def stats(self) -> dict[str, dict]:
        return {"tcp": self._stats.snapshot()}

    def close(self) -> None:
        self._server.close()
        self._client.close()
        for pool in self._senders.values():
            pool.shutdown(wait=False, cancel_futures=True)

    def _send(self, peer: str, slices: list[Slice], message: bytes | None, batch: Batch) -> None:
        try:
            parts = [self._regions[s.local_region].view[s.local_offset: s.local_offset + s.length] for s in slices]
            sums = [xxhash.xxh3_64_intdigest(p) for p in parts]
            payload = bytearray(b"".join(parts))
            if self.flip_next_slices > 0:
                self.flip_next_slices -= 1
                payload[len(payload) // 2] ^= 0xFF
            header = {"op": "write", "from": self.name, "sums": sums,
                      "slices": [[s.remote_region, s.remote_offset, s.length] for s in slices],
                      "message": base64.b64encode(message or b"").decode()}
            self._client.request(self._peers[peer].transports["tcp"], header, payload)
            batch.complete()
        except TcpTransferError as exc:
            error = ChecksumError(str(exc)) if "checksum" in str(exc) else TransferError(str(exc))
            batch.complete(error)
        except Exception as exc:  # noqa: BLE001 - a batch always completes
            batch.complete(TransferError(f"{type(exc).__name__}: {exc}"))

    def _on_frame(self, header: dict, payload: bytearray) -> dict:
        peer = str(header.get("from"))
        if header.get("op") == "call":
            assert self._on_call is not None
            reply = self._on_call(peer, base64.b64decode(header["body"]))
            return {"ok": True, "body": base64.b64encode(reply).decode()}
        if header.get("op") != "write":
            return {"ok": False, "error": f"unknown op {header.get('op')!r}"}
        message = base64.b64decode(header["message"]) or None
        view, at, error = memoryview(payload), 0, None
        for (region_name, offset, length), expected in zip(header["slices"], header["sums"]):
            part = view[at: at + length]
            at += length
            if xxhash.xxh3_64_intdigest(part) != expected:
                error = f"checksum mismatch on a slice of {length} B into {region_name}"
                break
            region = self._regions[region_name]
            region.check(offset, length)
            region.view[offset: offset + length] = part
        if message is not None and self._on_notify is not None:
            self._on_notify(peer, message, error)
        return {"ok": error is None, "error": error}
