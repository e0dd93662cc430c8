"""The transfer engine: registered regions, transports chosen per peer, checksums, calls, timeouts.

Users (the KV path, the pool) register memory, publish `info()`, `add_peer` what others publish,
then `write`/`read` batches of slices and `call` peers. The engine does what is the same for every
transport (messenger/api.py's Transport moves bytes and messages only):

- Transports: those of `config.transports` (preference order) whose module imports and whose
  `available()` is None. Each lives in its own module with a class built from the EngineConfig
  (`_TRANSPORT_CLASSES`); a missing module is skipped, so transports plug in without this file.
- Choice per peer: `messenger.select.choose(local, peer, transports)` when that module exists
  (transports: name -> Transport, in preference order; it returns a name), else the first
  transport in preference order whose `can_reach` says yes.
- Checksums (messenger/integrity.py): xxh3-64 per slice, hashed on a small thread pool while the
  transport already moves the bytes. The message handed to `Transport.submit` is a
  `PendingMessage`: its `checksums` blocks until the hashes are ready, so a transport reads it when
  it sends the message, after the slices. The receiving engine verifies them over its own memory in
  `slices_landed` before `on_notify`.
  A mismatch fails the sender's batch with ChecksumError (a transport passes the text
  `slices_landed` returned back into its TransferError; "ChecksumError:" in it marks the kind) and
  hands on_notify the error. A handler that raises NotifyRefused fails the sender's batch the
  same way (the bytes landed, but the receiver will not use them). Reads are not checksummed here: the
  side that serves a read has no engine hook in the contract (the pool checks its blocks itself).
- Messages: the engine wraps every payload in a one-byte envelope (a batch's notification or
  none; a call request with the caller's PeerInfo so the callee can answer; a call reply).
- Calls: on the peer's call lane (messenger/call_lane.py) when it publishes one, else as
  messages through its transport (messenger/transport_calls.py).
- Timeouts: a watchdog (messenger/watchdog.py) fails every batch and call that is not complete `timeout_s` after it was
  submitted, whatever the transport does (a dead or silent peer). It fails the transport's batch, not the user's: a
  READ landing in the caller's memory at that moment finishes first (messenger/api.py, Batch.begin_landing), so
  a caller whose wait raised owns its buffers again. A call's `timeout_s` bounds all of it, a redialled lane or the
  fallback to the transport included: one deadline, taken when the call starts.

on_notify and on_call run on the engine's and transports' threads: keep on_notify short (it holds
the stream it arrived on); on_call runs on the call's lane thread (messenger/call_lane.py: one per
calling thread and peer), or on a small pool of its own for calls that came through a transport.
"""

from __future__ import annotations

import importlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from messenger.api import (AttachmentSink, Batch, CallHandler, CallReply, ChecksumError, Direction, NoTransport,
                           NotifyHandler, NotifyRefused, OutgoingMessage, PeerInfo, Region, Slice, TimedOut,
                           TransferError, Transport)
from messenger.call_lane import FAILED as LANE_FAILED
from messenger.call_lane import OK as LANE_OK
from messenger.call_lane import LaneClient, LaneServer, LaneUnreachable
from messenger.integrity import CHECKSUM_ERROR_PREFIX, SliceHasher
from messenger.regions import RegionTable
from messenger.stats import TransportStats
from messenger.transport_calls import NOTIFY, REPLY, REPLY_ERROR, SILENT, TransportCalls
from messenger.watchdog import Watchdog

if TYPE_CHECKING:
    from messenger.nixl_transport import NixlConfig
    from messenger.rdma_plan import RdmaConfig
    from messenger.shm import ShmConfig

log = logging.getLogger(__name__)

# name -> (module, class); the class is built as cls(config: EngineConfig).
_TRANSPORT_CLASSES = {
    "tcp": ("messenger.tcp_transport", "TcpTransport"),
    "shm": ("messenger.shm", "ShmTransport"),
    "rdma": ("messenger.rdma", "RdmaTransport"),
    "nixl": ("messenger.nixl_transport", "NixlTransport"),
}


@dataclass(frozen=True)
class EngineConfig:
    """One transfer engine's settings (the one source of truth for their defaults)."""

    transports: tuple[str, ...] = ("shm", "rdma", "nixl", "tcp")
    """Preference order; those that do not import or say they cannot run here are skipped."""
    host: str = "127.0.0.1"
    """Where the tcp transport and the call lanes listen, and what they publish (0.0.0.0: all)."""
    advertise_host: str | None = None
    """What they (and rdma's control channel) publish when `host` is 0.0.0.0: the address other
    hosts reach this one at (the worker's --advertise-host); None: the address the hostname
    resolves to (messenger/tcp_link.py reachable_host)."""
    port: int = 0
    """tcp listen port (0: a free one)."""
    tcp_streams: int = 4
    """Parallel connections per peer: a batch's slices are spread over them."""
    timeout_s: float = 10.0
    """A batch or call not complete by then fails with TransferError (a dead or silent peer)."""
    checksums: bool = True
    """xxh3-64 per slice, computed off the caller's thread, verified by the receiver."""
    auth_key: bytes | None = field(default=None, repr=False)
    """Shared key every connection proves (messenger/handshake.py); None: no handshake."""
    hash_threads: int = 2
    """Threads hashing slices (xxh3 releases the GIL, so they overlap the sockets)."""
    call_lanes: bool = True
    """Calls on connections of their own (messenger/call_lane.py, a round trip with no thread
    hand-off); False: through the transport chosen for the peer."""
    call_port: int = 0
    """Where the call lanes listen, on `host` (0: a free one)."""
    rdma: RdmaConfig | None = None
    """The rdma transport's own settings (device, port, gid_index: RoCE v2 usually needs 1 or 3;
    RdmaConfig.from_env reads them from MOONCAKE_RDMA_*); None: RdmaConfig's defaults."""
    shm: ShmConfig | None = None
    """The shm transport's own settings; None: ShmConfig's defaults."""
    nixl: NixlConfig | None = None
    """The nixl transport's own settings; None: NixlConfig's defaults."""

    def __post_init__(self) -> None:
        unknown = [t for t in self.transports if t not in _TRANSPORT_CLASSES]
        if unknown or not self.transports:
            raise ValueError(f"EngineConfig.transports: unknown {unknown}; choose from {sorted(_TRANSPORT_CLASSES)}")
        if not 0 <= self.port < 65536 or not 0 <= self.call_port < 65536:
            raise ValueError(f"EngineConfig.port {self.port} / call_port {self.call_port}: not a port")
        if self.tcp_streams < 1 or self.hash_threads < 1:
            raise ValueError("EngineConfig.tcp_streams and hash_threads must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("EngineConfig.timeout_s must be positive")
        if self.auth_key is not None and len(self.auth_key) < 16:
            raise ValueError("EngineConfig.auth_key must be at least 16 bytes")


@dataclass
class _Peer:
    info: PeerInfo
    transport: Transport


class TransferEngine:
    """Moves bytes between this process's registered regions and its peers'. Thread-safe."""

    def __init__(self, name: str, config: EngineConfig = EngineConfig()) -> None:
        self.name = name
        self.config = config
        self._regions = RegionTable()
        self._transports: dict[str, Transport] = {}
        self._stats: dict[str, TransportStats] = {}
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._addresses: dict[str, str] = {}
        self._on_notify: NotifyHandler | None = None
        self._on_call: CallHandler | None = None
        self._info_lock = threading.Lock()  # a change and its version bump, together
        self._info_version = 0  # bumped when what info() returns changes (regions, addresses)
        self._info_json: tuple[int, bytes] = (-1, b"")  # (version, info() encoded): calls carry it
        self._hasher = SliceHasher(config.hash_threads, name)
        self._transport_calls = TransportCalls(name, self._run_call, self._send_reply)
        self._lane_server: LaneServer | None = None
        self._lane_stats = TransportStats()  # calls on lanes, both sides: "lane" in stats()
        self._lane_client = LaneClient(config.auth_key, self._lane_stats) if config.call_lanes else None
        self._call_address = ""
        self._watchdog = Watchdog()
        self._host_id = _host_id()
        self._started = False
        self._closed = False

    # --- regions -----------------------------------------------------------------------------

    def register(self, name: str, buffer=None, *, address: int | None = None, length: int | None = None,
                 device: str = "cpu") -> Region:
        """Register a writable CPU buffer (anything with the buffer protocol, C-contiguous), or
        device memory by `address` and `length` (only transports that reach devices can use it)."""
        if buffer is not None:
            view = memoryview(buffer)
            if view.readonly:
                raise ValueError(f"region {name!r}: the buffer is read-only")
            if not view.c_contiguous:
                raise ValueError(f"region {name!r}: the buffer is not contiguous")
            view = view.cast("B")
            if view.nbytes == 0:
                raise ValueError(f"region {name!r} is empty")
            region = Region(name, view.nbytes, np.frombuffer(view, dtype=np.uint8).ctypes.data, view, device)
        else:
            if address is None or not length or length <= 0:
                raise ValueError(f"region {name!r}: give a buffer, or an address and a positive length")
            region = Region(name, length, address, None, device)
        with self._info_lock:
            self._regions.add(region)
            self._info_version += 1
        return region

    def unregister(self, name: str) -> None:
        with self._info_lock:
            self._regions.remove(name)
            self._info_version += 1
        # Gone from the table first, so no new batch or peer's request registers it again; then
        # each transport releases its hold (rdma's MR, nixl's registration): a peer's cached key
        # must not keep reaching memory its owner gave up.
        for transport in self._transports.values():
            try:
                transport.unregister(name)
            except Exception:  # the region is gone here either way; the others still release theirs
                log.exception("messenger transport %s failed to release region %r", transport.name, name)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, on_notify: NotifyHandler | None = None, on_call: CallHandler | None = None) -> PeerInfo:
        """Start every transport that can run here; returns this engine's PeerInfo."""
        if self._started:
            raise RuntimeError(f"engine {self.name!r} already started")
        self._on_notify, self._on_call = on_notify, on_call
        reasons = {}
        for name in self.config.transports:
            transport, why = _make_transport(name, self.config)
            if transport is None:
                reasons[name] = why
                continue
            try:
                address = transport.start(self._regions, self)
                with self._info_lock:
                    self._addresses[name] = address
                    self._info_version += 1
            except Exception as exc:  # a transport that fails to start must not stop the others
                reasons[name] = f"failed to start: {exc}"
                log.warning("messenger transport %s failed to start: %s", name, exc)
                continue
            self._transports[name] = transport
            self._stats[name] = TransportStats()
        if not self._transports:
            raise NoTransport(f"no messenger transport can run here: {reasons}")
        if self.config.call_lanes:
            self._lane_server = LaneServer(self.config.host, self.config.call_port, self.config.auth_key,
                                           self.config.timeout_s, self._answer_lane, self.name, self._lane_stats,
                                           self.config.advertise_host)
            address = self._lane_server.start()
            with self._info_lock:
                self._call_address = address
                self._info_version += 1
        log.info("messenger %s: transports %s (skipped: %s)", self.name, list(self._transports), reasons)
        self._started = True
        return self.info()

    def info(self) -> PeerInfo:
        return PeerInfo(self.name, self._host_id, dict(self._addresses),
                        tuple(r.info() for r in self._regions.all()), self._call_address)

    def add_peer(self, peer: PeerInfo) -> str:
        """Remember `peer` (replacing what was known of it) and pick the transport to reach it."""
        name = self._choose(peer)
        with self._peers_lock:
            self._peers[peer.name] = _Peer(peer, self._transports[name])
        return name

    def _choose(self, peer: PeerInfo) -> str:
        if not self._started:
            raise RuntimeError(f"engine {self.name!r} is not started")
        local = self.info()
        try:
            select = importlib.import_module("messenger.select")
        except ModuleNotFoundError:
            select = None
        if select is not None and hasattr(select, "choose"):
            name = select.choose(local, peer, dict(self._transports))
            if name is None or name not in self._transports:
                raise NoTransport(f"no transport reaches peer {peer.name!r} (offers {sorted(peer.transports)})")
            return name
        for name, transport in self._transports.items():
            if transport.can_reach(local, peer):
                return name
        raise NoTransport(f"no transport reaches peer {peer.name!r}: it offers {sorted(peer.transports)}, "
                          f"this side runs {list(self._transports)}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for transport in self._transports.values():
            try:
                transport.close()
            except Exception:  # closing the others matters more
                log.exception("closing messenger transport %s", transport.name)
        self._transport_calls.close(f"engine {self.name!r} closed")
        if self._lane_server is not None:
            self._lane_server.close()
        if self._lane_client is not None:
            self._lane_client.close()
        self._watchdog.close()
        self._hasher.close()

    # --- batches -------------------------------------------------------------------------------

    def write(self, peer: str, slices: list[Slice], message: bytes | None = None) -> Batch:
        """Copy `slices` from local regions into `peer`'s; `message` reaches its on_notify after
        every slice landed and verified. Returns at once; wait on the Batch."""
        return self._submit(peer, Direction.WRITE, slices, message)

    def read(self, peer: str, slices: list[Slice]) -> Batch:
        """Copy `slices` from `peer`'s regions (remote_*) into local ones (local_*)."""
        return self._submit(peer, Direction.READ, slices, None)

    def _submit(self, peer_name: str, direction: Direction, slices: list[Slice], message: bytes | None) -> Batch:
        peer = self._peer(peer_name)
        views = self._local_views(slices, direction)
        for s in slices:
            remote = peer.info.region(s.remote_region)
            if remote is not None and s.remote_offset + s.length > remote.length:
                raise TransferError(f"slice {s} is outside {peer_name}'s region {remote.name!r} of {remote.length} B")
        nbytes = sum(s.length for s in slices)
        batch = Batch(nbytes, len(slices))
        outgoing = None
        if direction is Direction.WRITE:
            envelope = bytes([NOTIFY]) + message if message is not None else bytes([SILENT])
            if self.config.checksums and views:
                outgoing = self._hasher.outgoing(envelope, views)
            else:
                outgoing = OutgoingMessage(envelope)
        self._launch(peer, batch, f"{direction.value} of {len(slices)} slices to {peer_name}",
                     lambda inner: peer.transport.submit(peer.info, direction, slices, inner, outgoing))
        return batch

    def _launch(self, peer: _Peer, batch: Batch, what: str, submit) -> None:
        """Hand the transport an inner batch and finish the user's from it, and only from it: the
        engine maps the error kinds and counts stats. The watchdog times out the inner batch, so
        a transport landing bytes in the caller's memory (Batch.begin_landing) holds the timeout
        back until they are in: the user's waiter never wakes while its memory is written."""
        inner = Batch(batch.nbytes, batch.num_slices)
        inner.deadline = time.monotonic() + self.config.timeout_s  # the watchdog's, armed below
        stats, started = self._stats[peer.transport.name], time.perf_counter()

        def count(error: TransferError | None) -> None:  # the outcome the user's batch ends with
            if error is None:
                stats.request(time.perf_counter() - started)
            else:
                stats.failed("checksum" if isinstance(error, ChecksumError)
                             else "timeout" if isinstance(error, TimedOut) else "transfer")

        def finished(done: Batch) -> None:
            error = done.error
            if error is not None and not isinstance(error, ChecksumError) \
                    and f"{CHECKSUM_ERROR_PREFIX}:" in str(error):
                error = ChecksumError(str(error))
            batch.complete(error)

        batch.on_outcome(count)  # counted before a waiter wakes: it reads the stats next
        inner.add_done_callback(finished)
        self._watchdog.watch(inner, self.config.timeout_s, what)
        try:
            submit(inner)
        except TransferError as exc:  # nothing landed: it ends at once
            inner.complete(exc)
        except OSError as exc:
            inner.complete(TransferError(f"{what}: {exc}"))

    def _peer(self, name: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise TransferError(f"unknown peer {name!r}: add_peer its PeerInfo first")
        return peer

    def _local_views(self, slices: list[Slice], direction: Direction) -> list[memoryview]:
        """Bounds-check the local side; the views to hash for a WRITE (CPU regions only)."""
        views = []
        for s in slices:
            region = self._regions.get(s.local_region)
            region.check(s.local_offset, s.length)
            if direction is Direction.WRITE and region.view is not None:
                views.append(region.view[s.local_offset:s.local_offset + s.length])
        return views if len(views) == len(slices) else []

    # --- calls ---------------------------------------------------------------------------------

    def call(self, peer: str, request: bytes, timeout_s: float | None = None,
             into: AttachmentSink | None = None) -> bytes | bytearray:
        """Send `request` to `peer`'s on_call and return its reply, bytes-like (TransferError on
        failure or after timeout_s, the engine's by default: the whole call's, a lane's redial or
        the fallback to the transport included). On the peer's call lane when it has one, else
        through the transport chosen for it. A CallReply's attachment follows the body
        in what is returned, unless `into(body, nbytes)` names buffers for it (on a lane it is
        received straight into them)."""
        target = self._peer(peer)
        timeout = timeout_s if timeout_s is not None else self.config.timeout_s
        deadline = time.monotonic() + timeout  # the whole call's, whichever way it goes and however often
        if self._lane_client is not None and target.info.call_address:
            try:
                return self._lane_client.call(peer, target.info.call_address, self._caller_json(), request,
                                              timeout, into, deadline)
            except LaneUnreachable as exc:  # its lanes cannot be reached from here: its transport may be
                log.debug("%s; calling through %s", exc, target.transport.name)
        _, caller = self._caller_json()  # a call carries the caller's PeerInfo: the callee answers by it

        def send(what: str, payload: bytes, sent: Batch) -> None:
            self._launch(target, sent, what, lambda inner: target.transport.send_message(target.info, payload, inner))

        return self._transport_calls.call(peer, caller, request, timeout, send, into, deadline)

    def _caller_json(self) -> tuple[int, bytes]:
        """(version, this engine's PeerInfo as JSON), encoded once per change."""
        version, caller = self._info_json
        if version != self._info_version:
            version = self._info_version  # read first: a change during the encoding re-encodes next time
            caller = msgspec.json.encode(self.info())
            self._info_json = (version, caller)
        return version, caller

    # --- inbound (the transports call these) ---------------------------------------------------

    def slices_landed(self, peer: str, slices: list[Slice], message: OutgoingMessage | None) -> str | None:
        error = None
        checksums = message.checksums if message is not None else ()
        if checksums:
            error = self._hasher.verify(slices, checksums, self._regions.get)
        if message is not None and message.payload[:1] == bytes([NOTIFY]) and self._on_notify is not None:
            try:
                self._on_notify(peer, bytes(message.payload[1:]), error)
            except NotifyRefused as exc:  # landed, but not wanted here: the sender must not count it delivered
                error = error or f"NotifyRefused: {self.name} refused the batch: {exc}"
            except Exception:  # the sender's batch landed; a failing handler is this side's bug
                log.exception("on_notify failed for a batch from %s", peer)
        return error

    def batch_failed(self, peer: str, message: OutgoingMessage | None, error: str) -> None:
        """A transport lost a batch part-way (its peer died): tell on_notify at once."""
        if message is not None and message.payload[:1] == bytes([NOTIFY]) and self._on_notify is not None:
            try:
                self._on_notify(peer, bytes(message.payload[1:]), error)
            except Exception:
                log.exception("on_notify failed for a lost batch from %s", peer)

    def message(self, peer: str, payload: bytes) -> None:
        self._transport_calls.message(peer, payload)

    def _run_call(self, caller: PeerInfo, request: bytes) -> tuple[int, CallReply]:
        """on_call's answer to `caller`, (REPLY, its reply) or (REPLY_ERROR, the error's text);
        the caller becomes a known peer first, so the handler (and later calls) can reach it."""
        known = self._peers.get(caller.name)
        if known is None or (known.info is not caller and known.info != caller):
            try:
                self.add_peer(caller)
            except Exception as exc:  # noqa: BLE001 - it can still be answered where it called from
                log.debug("caller %s cannot be reached from here: %s", caller.name, exc)
        try:
            if self._on_call is None:
                raise TransferError(f"engine {self.name!r} takes no calls")
            reply = self._on_call(caller.name, request)
            return REPLY, reply if isinstance(reply, CallReply) else CallReply(reply)
        except Exception as exc:  # the caller gets the error instead of a timeout
            return REPLY_ERROR, CallReply(f"{type(exc).__name__}: {exc}".encode())

    def _answer_lane(self, raw_caller: bytes, request: bytes) -> tuple[int, CallReply]:
        kind, reply = self._run_call(self._transport_calls.caller(raw_caller), request)
        return (LANE_OK if kind == REPLY else LANE_FAILED), reply

    def _send_reply(self, caller: str, payload: bytes) -> None:
        """A transport call's reply, through the transport chosen for its caller."""
        if self._closed:  # the transports are closing: the caller's own timeout tells it
            return
        target = self._peer(caller)
        done = Batch(0, 0)
        self._watchdog.watch(done, self.config.timeout_s, f"reply to {caller}")
        target.transport.send_message(target.info, payload, done)

    # --- stats ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, dict]:
        """Per transport: its bytes moved (sent/received), batches completed (request_seconds:
        submit to completion) and failed by kind; "lane": the calls on call lanes (this engine's
        calls' round trips, and the bytes of calls both made and answered)."""
        out = {}
        for name, transport in self._transports.items():
            snap = dict(transport.stats())
            engine = self._stats[name].snapshot()
            snap["request_seconds"], snap["failures"] = engine["request_seconds"], engine["failures"]
            out[name] = snap
        if self.config.call_lanes:
            out["lane"] = self._lane_stats.snapshot()
        return out


def _make_transport(name: str, config: EngineConfig) -> tuple[Transport | None, str]:
    module_name, class_name = _TRANSPORT_CLASSES[name]
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            return None, f"needs {exc.name}, not installed"
        return None, "not built"
    except (ImportError, AttributeError) as exc:
        return None, f"does not import: {exc}"
    transport = cls(config)
    why = transport.available()
    return (transport, "") if why is None else (None, why)


def _host_id() -> str:
    try:
        select = importlib.import_module("messenger.select")
    except ModuleNotFoundError:
        select = None
    if select is not None and hasattr(select, "host_id"):
        return select.host_id()
    return socket.gethostname()
