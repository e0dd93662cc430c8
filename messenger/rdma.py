"""The rdma transport: RC queue pairs, RDMA WRITE / READ straight between registered regions.

Per peer this side writes to, it holds one outbound link: an RC queue pair plus a TCP control
connection to the peer's control channel (messenger/rdma_control.py says what travels there and
why). A peer that connects to us gets an inbound link the same way. A WRITE batch is a run of
RDMA WRITEs, each at most `max_message_bytes`; when a message rides on it, its last WRITE
carries the batch's sequence number as immediate data, and a Notice on the control channel says
which slices it wrote: the peer verifies them (the engine's `slices_landed`) and answers with an
Ack, which completes the batch here. A READ batch is a run of RDMA READs, complete when the last
one is. One thread polls the completion queue; send-queue depth caps the work requests posted
per queue pair (rdma_plan.SendQueue), the rest wait their turn in order.

Every region is registered with the NIC on first use (ibv_reg_mr, local write + remote write +
remote read), CPU memory by address and GPU memory by address when nvidia_peermem allows it
(GPUDirect); re-registering a name at another address re-registers the MR.

The local engine's name (what the far side's on_notify sees) is the inbound handler's `name`
(the engine is the handler), else the `local` PeerInfo of the first `can_reach`.

What never ran: see messenger/rdma_verbs.py; on a machine without a device `available()` says
why and `start` raises TransferError.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from messenger import rdma_control as ctl
from messenger.api import Batch, Direction, OutgoingMessage, PeerInfo, Region, Slice, TransferError
from messenger.handshake import client_handshake, server_handshake
from messenger.peer_queues import PeerQueues
from messenger.rdma_plan import (RECV_TAG, BatchBook, LocalKey, PortAddress, QpEndpoint, RdmaConfig, RemoteRegion,
                                 RkeyTable, SendQueue, describe_completion_error, plan_work_requests)
from messenger.rdma_verbs import VerbsPort, VerbsQp, device_names, new_psn, open_pyverbs_port, pyverbs_missing
from messenger.stats import TransportStats
from messenger.tcp_link import WILDCARD_HOSTS, reachable_host

log = logging.getLogger(__name__)


class _Link:
    """One queue pair and its control connection, to or from one peer."""

    def __init__(self, peer: str, qp: VerbsQp, channel: ctl.ControlChannel, config: RdmaConfig, outbound: bool):
        self.peer = peer
        self.outbound = outbound  # ours to write through (its batches are in our BatchBook)
        self.qp = qp
        self.channel = channel
        self.lock = threading.Lock()
        self.sendq = SendQueue(config.send_depth, config.recv_depth)
        self.rkeys = RkeyTable()
        self.inbound = ctl.InboundBook()
        self.replies: list[ctl.Regions] = []
        self.replied = threading.Condition(self.lock)
        self.broken: str | None = None


class RdmaTransport:
    name = "rdma"

    def __init__(self, config, rdma: RdmaConfig | None = None, *,
                 open_port: Callable[[RdmaConfig], VerbsPort] = open_pyverbs_port):
        self._config = config  # the engine's EngineConfig: timeout_s, auth_key
        self._rdma = rdma or getattr(config, "rdma", None) or RdmaConfig()
        self._open_port = open_port
        self._stats = TransportStats()
        self._book = BatchBook()
        self._lock = threading.Lock()
        # Submissions (connecting, asking for regions, planning) on one thread per peer: a frozen
        # peer delays only its own batches. A peer's links are made on its thread only: no duplicates.
        self._submitter = PeerQueues("rdma-submit")
        # Notices (sender) and checksum checks with their acks (receiver) go out on the control
        # socket, whose send blocks once a frozen peer's TCP window is full: one thread per peer
        # each, so that peer holds up only its own.
        self._noticer = PeerQueues("rdma-notice")
        self._verifier = PeerQueues("rdma-verify")
        self._local_name: str | None = None
        self._port: VerbsPort | None = None
        self._mrs: dict[str, tuple[LocalKey, int, object]] = {}  # name -> (key, rkey, MR handle)
        self._outbound: dict[str, _Link] = {}  # peer name -> link
        self._by_qpn: dict[int, _Link] = {}
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- the Transport protocol -------------------------------------------------------------

    def available(self) -> str | None:
        if self._open_port is not open_pyverbs_port:
            return None  # a port opener given by the caller (tests' fake fabric) decides in start
        if why := pyverbs_missing():
            return why
        try:
            names = device_names()
        except TransferError as exc:
            return str(exc)
        return None if names else "no RDMA device: ibv_get_device_list() is empty"

    def start(self, regions, deliver) -> str:
        self._regions, self._deliver = regions, deliver
        self._local_name = getattr(deliver, "name", None)  # the engine is the handler and has its name
        self._port = self._open_port(self._rdma)  # raises TransferError where there is no device
        self._listener = socket.create_server((self._rdma.control_host, 0))
        # The control channel listens on every interface by default; peers reach it where the
        # engine's other transports are reached.
        bound = self._config.host if self._rdma.control_host in WILDCARD_HOSTS else self._rdma.control_host
        host = reachable_host(bound, self._config.advertise_host)
        for target, name in ((self._accept_loop, "rdma-accept"), (self._poll_loop, "rdma-poll")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        p = self._port
        return PortAddress(p.device, p.port, p.lid, p.gid, p.mtu, f"{host}:{self._listener.getsockname()[1]}").encode()

    def can_reach(self, local: PeerInfo, peer: PeerInfo) -> bool:
        self._local_name = self._local_name or local.name
        if "rdma" not in local.transports or "rdma" not in peer.transports:
            return False
        try:
            PortAddress.decode(peer.transports["rdma"])
        except TransferError:
            return False
        return True

    def submit(self, peer: PeerInfo, direction: Direction, slices: list[Slice], batch: Batch,
               message: OutgoingMessage | None) -> None:
        # Connecting, asking for a peer's regions and registering memory may take a round trip
        # or a page-pinning pass: never on the caller's thread. The peer's thread keeps its order.
        self._submitter.submit(peer.name, batch, self._submit_now, peer, direction, slices, batch, message)

    def _submit_now(self, peer: PeerInfo, direction: Direction, slices: list[Slice], batch: Batch,
                    message: OutgoingMessage | None) -> None:
        if batch.done():  # timed out while it waited its turn (e.g. behind a connect to a frozen peer)
            return
        try:
            link = self._link_to(peer, {s.remote_region for s in slices})
            self._want_regions(link, {s.remote_region for s in slices})
            requests = plan_work_requests(direction, slices, self._local_key, link.rkeys, self._rdma.max_message_bytes)
        except Exception as exc:  # noqa: BLE001 -- pyverbs raises its own errors (ibv_reg_mr refused, ...)
            batch.complete(exc if isinstance(exc, TransferError) else TransferError(f"rdma batch to {peer.name!r}: {exc}"))
            return
        awaits_ack = message is not None and direction is Direction.WRITE
        if not requests and not awaits_ack:  # nothing to move and nobody to tell
            batch.complete()
            return
        seq, numbered = self._book.open(peer.name, batch, requests, awaits_ack)
        self._post(link, lambda: link.sendq.enqueue(numbered))
        if awaits_ack:  # its checksums may still be computing: wait for them on the notice thread
            self._noticer.submit(link.peer, batch, self._send_notice, link, seq, slices, message)

    def _send_notice(self, link: _Link, seq: int, slices: list[Slice], message: OutgoingMessage) -> None:
        try:
            notice = ctl.Notice(seq, [(s.local_region, s.local_offset, s.remote_region, s.remote_offset, s.length)
                                      for s in slices], message.payload, list(message.checksums))
        except Exception as exc:  # noqa: BLE001 -- hashing failed (an engine bug): its immediate is
            # already posted and would hold one of the peer's receives forever; start the link afresh
            self._break(link, f"rdma link to {link.peer!r} reset: checksums of batch {seq} failed: {exc}")
            return
        try:
            link.channel.send(notice)
        except (OSError, TransferError) as exc:
            self._break(link, f"rdma link to {link.peer!r} lost: {exc}")

    def send_message(self, peer: PeerInfo, payload: bytes, batch: Batch) -> None:
        # It may have to connect first: on the peer's submit thread, in order with the batches.
        self._submitter.submit(peer.name, batch, self._send_message_now, peer, payload, batch)

    def _send_message_now(self, peer: PeerInfo, payload: bytes, batch: Batch) -> None:
        if batch.done():
            return
        try:
            link = self._link_to(peer, set())
            link.channel.send(ctl.Message(payload))
        except (OSError, TransferError) as exc:
            batch.complete(exc if isinstance(exc, TransferError) else TransferError(str(exc)))
            return
        self._stats.moved(sent=len(payload))
        batch.complete()

    def stats(self) -> dict:
        snapshot = self._stats.snapshot()
        snapshot["in_flight_batches"] = self._book.in_flight()
        return snapshot

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        listener = getattr(self, "_listener", None)
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
            except OSError:
                pass
            listener.close()
        with self._lock:
            links = list(self._by_qpn.values())
        for link in links:
            self._break(link, "rdma transport closed")
        for thread in self._threads:
            thread.join(timeout=5)
        for queues in (self._submitter, self._noticer, self._verifier):
            queues.close(wait=False)
        for _, _, handle in self._mrs.values():
            self._port.deregister(handle)
        self._mrs.clear()
        if self._port is not None:
            self._port.close()

    # -- regions ------------------------------------------------------------------------------

    def _register(self, region: Region) -> LocalKey:
        """The region's MR, registered now unless it already is at the same address and length."""
        with self._lock:
            known = self._mrs.get(region.name)
            if known and known[0].address == region.address and known[0].length == region.length:
                return known[0]
            if known:  # the name was registered again elsewhere: the old MR must not stay reachable
                self._port.deregister(known[2])
                del self._mrs[region.name]
            lkey, rkey, handle = self._port.register(region.address, region.length, region.device)
            key = LocalKey(region.address, region.length, lkey)
            self._mrs[region.name] = (key, rkey, handle)
            return key

    def unregister(self, name: str) -> None:
        """Deregister the region's MR: the rkey peers cached stops working (their writes and
        reads fail with a remote access error) instead of reaching memory its owner gave up."""
        with self._lock:
            known = self._mrs.pop(name, None)
            if known is not None:
                self._port.deregister(known[2])

    def _local_key(self, name: str) -> LocalKey:
        try:
            region = self._regions.get(name)
        except KeyError:
            raise TransferError(f"no registered region {name!r} here") from None
        return self._register(region)

    def _export(self, names: list[str]) -> tuple[list[RemoteRegion], list[str]]:
        """Our regions `names` as a peer needs them (registering them now); and those we lack."""
        found, missing = [], []
        for name in names:
            try:
                key = self._local_key(name)
            except (KeyError, TransferError):
                missing.append(name)
                continue
            with self._lock:
                rkey = self._mrs[name][1]
            found.append(RemoteRegion(name, key.address, key.length, rkey))
        return found, missing

    # -- links --------------------------------------------------------------------------------

    def _link_to(self, peer: PeerInfo, wanted: set[str]) -> _Link:
        """The live outbound link to `peer`, connected now if need be (on its submit thread only)."""
        with self._lock:
            link = self._outbound.get(peer.name)
        if link is not None and link.broken is None:
            return link
        return self._connect(peer, wanted)

    def _connect(self, peer: PeerInfo, wanted: set[str]) -> _Link:
        if self._local_name is None:
            raise TransferError("rdma transport does not know its engine's name yet (can_reach was never called)")
        if "rdma" not in peer.transports:
            raise TransferError(f"peer {peer.name!r} publishes no rdma address")
        address = PortAddress.decode(peer.transports["rdma"])
        try:
            sock = socket.create_connection(address.control_address(), timeout=self._config.timeout_s)
        except OSError as exc:
            raise TransferError(f"cannot reach {peer.name!r}'s rdma control channel {address.control}: {exc}") from exc
        qp = None
        try:
            if self._config.auth_key is not None:
                client_handshake(sock, self._config.auth_key)
            channel = ctl.ControlChannel(sock)
            qp = self._port.create_qp()
            mine = self._endpoint(qp)
            channel.send(ctl.Connect(self._local_name, mine, sorted(wanted)))
            reply = channel.receive()
            if not isinstance(reply, ctl.Connected):
                raise TransferError(f"rdma peer {peer.name!r} answered Connect with {type(reply).__name__}")
            qp.connect(mine, reply.endpoint)
        except (OSError, TransferError) as exc:
            sock.close()
            if qp is not None:
                qp.close()
            raise TransferError(f"cannot connect an rdma queue pair to {peer.name!r}: {exc}") from exc
        sock.settimeout(None)
        link = _Link(peer.name, qp, channel, self._rdma, outbound=True)
        link.rkeys.update(reply.regions)
        with self._lock:
            old = self._outbound.get(peer.name)
            self._outbound[peer.name] = link
            self._by_qpn[qp.qpn] = link
        if old is not None:
            self._break(old, "replaced by a new rdma link")
        if self._closed.is_set():  # close() ran while this connected: it did not see this link
            self._break(link, "rdma transport closed")
            raise TransferError("rdma transport closed")
        self._spawn(self._outbound_loop, link, f"rdma-out-{peer.name}")
        return link

    def _want_regions(self, link: _Link, names: set[str]) -> None:
        missing = link.rkeys.missing(names)
        if not missing:
            return
        with link.lock:
            link.channel.send(ctl.RegionsWanted(missing))
            deadline = time.monotonic() + self._config.timeout_s
            while not link.replies and link.broken is None:
                if not link.replied.wait(max(0.0, deadline - time.monotonic())):
                    raise TransferError(f"rdma peer {link.peer!r} did not answer for its regions {missing}")
            if link.broken is not None:
                raise TransferError(link.broken)
            reply = link.replies.pop(0)
        link.rkeys.update(reply.regions)
        if reply.missing:
            raise TransferError(f"peer {link.peer!r} has no registered region {reply.missing[0]!r}")

    def _endpoint(self, qp: VerbsQp) -> QpEndpoint:
        p = self._port
        return QpEndpoint(qp.qpn, new_psn(), p.lid, p.gid, p.mtu)

    def _outbound_loop(self, link: _Link) -> None:
        """Answers on our outbound control connection: region tables and acks."""
        try:
            while True:
                frame = link.channel.receive()
                if isinstance(frame, ctl.Ack):
                    if frame.error is not None:  # e.g. a region it no longer has: ask again next time
                        link.rkeys.clear()
                    self._book.acked(frame.seq, frame.error)
                    self._post(link, link.sendq.acked)
                elif isinstance(frame, ctl.Regions):
                    with link.lock:
                        link.replies.append(frame)
                        link.replied.notify_all()
                else:
                    raise TransferError(f"unexpected {type(frame).__name__} on an outbound rdma link")
        except TransferError as exc:
            self._break(link, f"rdma link to {link.peer!r} lost: {exc}")

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._spawn(self._inbound_loop, sock, "rdma-in")

    def _inbound_loop(self, sock: socket.socket) -> None:
        """A peer's queue pair to us: connect it, then serve its notices, region requests, messages."""
        link = None
        try:
            sock.settimeout(self._config.timeout_s)
            if self._config.auth_key is not None:
                server_handshake(sock, self._config.auth_key)
            channel = ctl.ControlChannel(sock)
            hello = channel.receive()
            if not isinstance(hello, ctl.Connect):
                raise TransferError(f"expected Connect, got {type(hello).__name__}")
            qp = self._port.create_qp()
            link = _Link(hello.name, qp, channel, self._rdma, outbound=False)
            with self._lock:
                self._by_qpn[qp.qpn] = link
            qp.post_receives([RECV_TAG | i for i in range(self._rdma.recv_depth)])
            mine = self._endpoint(qp)
            qp.connect(mine, hello.endpoint)
            regions, missing = self._export(hello.wanted)
            channel.send(ctl.Connected(mine, regions, missing))
            sock.settimeout(None)
            while True:
                frame = channel.receive()
                if isinstance(frame, ctl.Notice):  # a message without slices has no immediate to wait for
                    if not frame.slices or (frame := link.inbound.notice(frame)) is not None:
                        self._verifier.submit(link.peer, None, self._verify, link, frame)
                elif isinstance(frame, ctl.RegionsWanted):
                    channel.send(ctl.Regions(*self._export(frame.names)))
                elif isinstance(frame, ctl.Message):
                    self._stats.moved(received=len(frame.payload))
                    self._deliver.message(link.peer, frame.payload)
                else:
                    raise TransferError(f"unexpected {type(frame).__name__} on an inbound rdma link")
        except Exception as exc:  # noqa: BLE001 -- one bad peer must not take the listener down
            if link is not None:
                self._break(link, f"rdma link from {link.peer!r} lost: {exc}")
            else:
                log.warning("rdma: refused a connection: %s", exc)
                sock.close()

    def _verify(self, link: _Link, notice: ctl.Notice) -> None:
        slices = [Slice(*s) for s in notice.slices]
        self._stats.moved(received=sum(s.length for s in slices))
        try:
            error = self._deliver.slices_landed(link.peer, slices,
                                                OutgoingMessage(notice.payload, tuple(notice.checksums)))
        except Exception as exc:  # noqa: BLE001 -- the sender must hear of it, not time out
            error = f"the receiver failed: {exc}"
        try:
            link.channel.send(ctl.Ack(notice.seq, error))
        except OSError as exc:
            self._break(link, f"rdma link from {link.peer!r} lost: {exc}")

    # -- completions ----------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        while not self._closed.is_set():
            completions = self._port.poll(64)
            if not completions:
                time.sleep(self._rdma.poll_idle_s)
                continue
            for c in completions:
                with self._lock:
                    link = self._by_qpn.get(c.qpn)
                if link is None:
                    continue  # a link already torn down: its batches failed with it
                if c.inbound:
                    self._on_receive(link, c)
                else:
                    self._on_send(link, c)

    def _on_receive(self, link: _Link, c) -> None:
        if c.status != 0:
            self._break(link, f"rdma link from {link.peer!r}: {describe_completion_error(c.status, c.vendor_err)}")
            return
        try:
            link.qp.post_receives([c.wr_id])  # one receive per immediate: keep the queue full
        except Exception as exc:  # noqa: BLE001
            self._break(link, f"rdma link from {link.peer!r}: cannot post a receive: {exc}")
            return
        if (ready := link.inbound.landed(c.imm)) is not None:
            self._verifier.submit(link.peer, None, self._verify, link, ready)

    def _on_send(self, link: _Link, c) -> None:
        if c.status != 0:
            self._break(link, f"rdma link to {link.peer!r}: {describe_completion_error(c.status, c.vendor_err)}")
            return
        self._book.request_done(c.wr_id, counted=self._count_request)
        self._post(link, lambda: link.sendq.completed(1))

    def _count_request(self, request) -> None:
        """A work request of ours completed (BatchBook.request_done calls it before its batch can end)."""
        if request.opcode is Direction.WRITE:
            self._stats.moved(sent=request.length)
        else:
            self._stats.moved(received=request.length)

    def _post(self, link: _Link, release: Callable[[], list]) -> None:
        """Post what the send queue releases, in order (under the link's lock); a refused post
        (ibv_post_send failed: the QP is in error, or the queue is full) ends the link."""
        with link.lock:
            if link.broken is not None:
                return
            ready = release()
            try:
                if ready:
                    link.qp.post(ready)
                return
            except Exception as exc:  # noqa: BLE001 -- pyverbs raises its own PyverbsRDMAError
                reason = f"rdma link to {link.peer!r}: posting {len(ready)} work requests failed: {exc}"
        self._break(link, reason)

    def _break(self, link: _Link, reason: str) -> None:
        """Tear a link down once: fail its batches, forget it, close its QP and connection."""
        with link.lock:
            if link.broken is not None:
                return
            link.broken = reason
            link.sendq.drain()
            link.replied.notify_all()
        with self._lock:
            if self._outbound.get(link.peer) is link:
                del self._outbound[link.peer]
            self._by_qpn = {qpn: l for qpn, l in self._by_qpn.items() if l is not link}
        failed = self._book.fail_peer(link.peer, reason) if link.outbound else 0
        log.log(logging.WARNING if failed else logging.INFO, "%s (%d batches failed)", reason, failed)
        link.channel.close()
        link.qp.close()

    def _spawn(self, target, arg, name: str) -> None:
        threading.Thread(target=target, args=(arg,), name=name, daemon=True).start()
