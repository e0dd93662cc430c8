"""The nixl transport: NIXL's UCX backend (the library vLLM, Dynamo and llm-d move KV with).

Each engine runs one NIXL agent, named uniquely; its descriptor in PeerInfo.transports["nixl"]
is the agent's metadata (base64 in JSON), which carries the UCX worker address. Regions are
registered with the agent on first use (DRAM; VRAM for "cuda:N" regions). A peer's regions are
asked for when a slice first names them, over NIXL notifications:

    initiator -> target   Want(names, the initiator's metadata)
    target -> initiator   Regions(addresses and lengths, partial metadata with their keys)

A WRITE batch is one NIXL transfer whose notification is a Notice (the batch's slices, message
and checksums): NIXL delivers it after the bytes. The target verifies (the engine's
`slices_landed`) and answers with an Ack notification, which completes the batch here. A READ
batch completes when its transfer does. Calls and replies are plain notifications (Message).

Threads: NIXL's own progress thread busy-polls a core (its Python API fixes the delay at 0), so
it is off; one thread here polls transfers and notifications (which drives UCX's progress on
both sides) and sleeps `poll_idle_s` when nothing moved. The agent is not thread-safe in the
mode used, so every call into it holds one lock.

UCX reads its settings from the environment only: `start` sets UCX_MODULES=^ib (without it,
every process crashes at exit on machines without InfiniBand) and UCX_TLS from NixlConfig,
unless the process environment already names them.
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec

from messenger.api import Batch, Direction, OutgoingMessage, PeerInfo, Region, Slice, TransferError
from messenger.nixl_wire import Ack, Address, Message, Notice, Notification, Regions, Want, decode, encode
from messenger.peer_queues import PeerQueues
from messenger.stats import TransportStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NixlConfig:
    """Settings of the nixl transport (the engine's EngineConfig holds what every transport shares)."""

    ucx_tls: str = "tcp,sm,self"  # UCX transports; NIXL's peer-failure handling wants tcp listed with sm
    poll_idle_s: float = 0.0002  # the polling thread's sleep when nothing moved

    def __post_init__(self) -> None:
        if not self.ucx_tls.strip():
            raise ValueError("nixl ucx_tls must name at least one UCX transport (e.g. 'tcp,self')")
        if self.poll_idle_s < 0:
            raise ValueError(f"nixl poll_idle_s must be >= 0, got {self.poll_idle_s}")


def nixl_missing() -> str | None:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError as exc:
        return f"nixl not importable: {exc} (pip install --no-deps nixl-cu12==1.5.1)"
    return None


@dataclass
class _Peer:
    agent: str
    regions: dict[str, tuple[int, int, str, int]] = field(default_factory=dict)  # name -> address, length, kind, device
    answered: threading.Condition = field(default_factory=threading.Condition)
    missing: list[str] = field(default_factory=list)


@dataclass
class _Transfer:
    batch: Batch
    handle: object
    peer: str
    nbytes: int
    direction: Direction
    seq: int | None  # set when the peer must acknowledge (a message rode on it)
    done: bool = False  # the transfer finished here; an ack may still be due
    ack_error: TransferError | None = None  # what an ack that overtook the completion said


class NixlTransport:
    name = "nixl"

    def __init__(self, config, nixl: NixlConfig | None = None):
        self._config = config  # the engine's EngineConfig: timeout_s
        self._nixl = nixl or getattr(config, "nixl", None) or NixlConfig()
        self._stats = TransportStats()
        self._lock = threading.Lock()  # the agent and the tables below
        self._local_name: str | None = None
        self._registered: dict[str, tuple[int, int, object]] = {}  # name -> (address, length, reg descs)
        self._peers: dict[str, _Peer] = {}  # engine name -> peer
        self._agents: set[str] = set()  # remote agents whose metadata is loaded
        self._transfers: list[_Transfer] = []
        self._acks: dict[int, _Transfer] = {}
        self._seq = itertools.count(1)
        self._closed = threading.Event()
        # Submissions on one thread per peer: one asking a frozen peer for its regions (up to
        # timeout_s) delays that peer's batches only.
        self._submitter = PeerQueues("nixl-submit")
        self._agent = None
        self._thread: threading.Thread | None = None

    # -- the Transport protocol -------------------------------------------------------------

    def available(self) -> str | None:
        if self._config.auth_key is not None:
            # NIXL's agents answer any agent that knows their name (metadata, notifications): no
            # handshake here could prove the shared key, so a keyed engine must not open one.
            return "cannot authenticate peers, and this engine has an auth_key"
        return nixl_missing()

    def start(self, regions, deliver) -> str:
        if why := nixl_missing():
            raise TransferError(why)
        os.environ.setdefault("UCX_MODULES", "^ib")
        os.environ.setdefault("UCX_TLS", self._nixl.ucx_tls)
        from nixl_cu12 import nixl_agent, nixl_agent_config

        self._regions, self._deliver = regions, deliver
        self._local_name = getattr(deliver, "name", None)  # the engine is the handler and has its name
        self._agent_name = f"mooncake-{uuid.uuid4().hex}"
        try:
            self._agent = nixl_agent(self._agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as exc:  # noqa: BLE001 -- NIXL raises its own error types
            raise TransferError(f"cannot start a NIXL agent with the UCX backend: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL has no UCX backend here")
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="nixl-verify")
        self._thread = threading.Thread(target=self._poll_loop, name="nixl-poll", daemon=True)
        self._thread.start()
        return msgspec.json.encode(Address(self._agent_name, base64.b64encode(self._metadata()).decode())).decode()

    def can_reach(self, local: PeerInfo, peer: PeerInfo) -> bool:
        self._local_name = self._local_name or local.name
        return "nixl" in local.transports and _address(peer) is not None

    def submit(self, peer: PeerInfo, direction: Direction, slices: list[Slice], batch: Batch,
               message: OutgoingMessage | None) -> None:
        # The Notice rides on the transfer (NIXL delivers it after the bytes; a notification sent
        # on its own has no such order), so the transfer waits for the batch's checksums; that,
        # a first round trip for the peer's regions and registering memory happen on this
        # transport's submit thread for the peer, never the caller's; it keeps the peer's order.
        self._submitter.submit(peer.name, batch, self._submit_now, peer, direction, slices, batch, message)

    def _submit_now(self, peer: PeerInfo, direction: Direction, slices: list[Slice], batch: Batch,
                    message: OutgoingMessage | None) -> None:
        if batch.done():  # timed out while it waited its turn
            return
        if not slices:
            self._submit_empty(peer, direction, batch, message)
            return
        try:
            remote = self._peer(peer)
            self._want(peer.name, remote, {s.remote_region for s in slices})
            local_kind, local_descs, remote_kind, remote_descs = self._descriptors(remote, slices)
            seq = next(self._seq) if message is not None and direction is Direction.WRITE else None
            notice = b"" if seq is None else encode(Notice(
                self._sender(), seq, [(s.local_region, s.local_offset, s.remote_region, s.remote_offset, s.length)
                                      for s in slices], message.payload, list(message.checksums)))
            with self._lock:
                handle = self._agent.initialize_xfer(direction.value.upper(), self._agent.get_xfer_descs(
                    local_descs, local_kind), self._agent.get_xfer_descs(remote_descs, remote_kind), remote.agent, notice)
                transfer = _Transfer(batch, handle, peer.name, sum(s.length for s in slices), direction, seq)
                if seq is not None:
                    self._acks[seq] = transfer
                state = self._agent.transfer(handle)
                if state == "ERR":
                    self._acks.pop(seq, None)
                    self._agent.release_xfer_handle(handle)
                    raise TransferError(f"NIXL refused to post the transfer to {peer.name!r}")
                self._transfers.append(transfer)
        except TransferError as exc:
            batch.complete(exc)
        except Exception as exc:  # noqa: BLE001 -- NIXL's errors (nixlNotFoundError, ...) say what is wrong
            batch.complete(TransferError(f"nixl transfer to {peer.name!r} failed: {type(exc).__name__}: {exc}"))

    def _submit_empty(self, peer: PeerInfo, direction: Direction, batch: Batch, message: OutgoingMessage | None) -> None:
        """A batch without slices: nothing to order a notification after, so a WRITE's Notice goes
        on its own and the batch completes on its Ack."""
        if message is None or direction is Direction.READ:
            batch.complete()
            return
        seq = next(self._seq)
        try:
            remote = self._peer(peer)
            with self._lock:
                self._acks[seq] = _Transfer(batch, None, peer.name, 0, direction, seq, done=True)
            self._notify(remote.agent, Notice(self._sender(), seq, [], message.payload, list(message.checksums)))
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                self._acks.pop(seq, None)
            batch.complete(exc if isinstance(exc, TransferError) else TransferError(f"nixl notice failed: {exc}"))

    def send_message(self, peer: PeerInfo, payload: bytes, batch: Batch) -> None:
        try:
            remote = self._peer(peer)
            self._notify(remote.agent, Message(self._sender(), payload))
        except Exception as exc:  # noqa: BLE001
            batch.complete(exc if isinstance(exc, TransferError) else TransferError(f"nixl message failed: {exc}"))
            return
        self._stats.moved(sent=len(payload))
        batch.complete()

    def stats(self) -> dict:
        snapshot = self._stats.snapshot()
        with self._lock:
            snapshot["in_flight_batches"] = len(self._transfers) + sum(1 for t in self._acks.values() if t.done)
        return snapshot

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._submitter.close(wait=True)  # the agent goes below: nothing may still use it
            self._verifier.shutdown(wait=True, cancel_futures=True)
            self._thread.join(timeout=5)
        with self._lock:
            transfers, self._transfers, acks, self._acks = self._transfers, [], self._acks, {}
        for t in transfers + [t for t in acks.values() if t.done]:
            t.batch.complete(TransferError("nixl transport closed"))
        if self._agent is not None:
            with self._lock:
                for t in transfers:
                    _quietly(self._agent.release_xfer_handle, t.handle)
                for agent in self._agents:
                    _quietly(self._agent.remove_remote_agent, agent)
                for _, _, descs in self._registered.values():
                    _quietly(self._agent.deregister_memory, descs)
                self._registered.clear()

    # -- peers and regions ------------------------------------------------------------------------

    def _sender(self) -> str:
        if self._local_name is None:
            raise TransferError("nixl transport does not know its engine's name yet (can_reach was never called)")
        return self._local_name

    def _metadata(self) -> bytes:
        with self._lock:
            return self._agent.get_agent_metadata()

    def _load(self, metadata: bytes) -> str:
        """Load a peer agent's (full or partial) metadata; returns its agent name."""
        with self._lock:
            agent = self._agent.add_remote_agent(metadata)
            agent = agent.decode() if isinstance(agent, bytes) else agent
            self._agents.add(agent)
            return agent

    def _peer(self, peer: PeerInfo) -> _Peer:
        with self._lock:
            known = self._peers.get(peer.name)
        address = _address(peer)
        if address is None:
            raise TransferError(f"peer {peer.name!r} publishes no usable nixl address")
        if known is not None and known.agent == address.agent:
            return known
        self._load(base64.b64decode(address.metadata))  # a new peer, or the same name restarted
        remote = _Peer(address.agent)
        with self._lock:
            self._peers[peer.name] = remote
        return remote

    def _want(self, name: str, remote: _Peer, names: set[str]) -> None:
        with remote.answered:
            wanted = sorted(n for n in names if n not in remote.regions)
            if not wanted:
                return
            remote.missing = []
        self._notify(remote.agent, Want(self._sender(), self._metadata(), wanted))
        deadline = time.monotonic() + self._config.timeout_s
        with remote.answered:
            while any(n not in remote.regions for n in wanted) and not set(wanted) & set(remote.missing):
                if not remote.answered.wait(max(0.0, deadline - time.monotonic())):
                    raise TransferError(f"nixl peer {name!r} did not answer for its regions {wanted}")
            lacking = sorted(set(wanted) & set(remote.missing))
        if lacking:
            raise TransferError(f"peer {name!r} has no registered region {lacking[0]!r}")

    def _descriptors(self, remote: _Peer, slices: list[Slice]) -> tuple[str, list[tuple], str, list[tuple]]:
        """(local kind, local descriptors, remote kind, remote descriptors) of a batch; one NIXL
        transfer moves one kind of memory (DRAM or VRAM) on each side."""
        local_descs, remote_descs, local_kinds, remote_kinds = [], [], set(), set()
        for s in slices:
            region = self._register(s.local_region)
            region.check(s.local_offset, s.length)
            with remote.answered:
                address, length, kind, device_id = remote.regions[s.remote_region]
            if s.remote_offset + s.length > length:
                raise TransferError(f"slice [{s.remote_offset}, {s.remote_offset + s.length}) is outside the peer's "
                                    f"region {s.remote_region!r} of {length} B")
            local_descs.append((region.address + s.local_offset, s.length, _device_id(region)))
            remote_descs.append((address + s.remote_offset, s.length, device_id))
            local_kinds.add(_kind(region))
            remote_kinds.add(kind)
        if len(local_kinds) > 1 or len(remote_kinds) > 1:
            raise TransferError("a nixl batch moves one kind of memory (DRAM or VRAM) per side: split it")
        return local_kinds.pop(), local_descs, remote_kinds.pop(), remote_descs

    def _register(self, name: str) -> Region:
        try:
            region = self._regions.get(name)
        except KeyError:
            raise TransferError(f"no registered region {name!r} here") from None
        with self._lock:
            known = self._registered.get(name)
            if known and known[:2] == (region.address, region.length):
                return region
            if known:  # re-registered elsewhere under the same name
                _quietly(self._agent.deregister_memory, known[2])
            descs = self._agent.register_memory([(region.address, region.length, _device_id(region), name)],
                                                _kind(region))
            self._registered[name] = (region.address, region.length, descs)
        return region

    def unregister(self, name: str) -> None:
        """Deregister the region from the agent: registrations must not pile up (the KV sender
        registers a region per layer and step), nor stay reachable through keys peers hold."""
        with self._lock:
            known = self._registered.pop(name, None)
            if known is not None:
                _quietly(self._agent.deregister_memory, known[2])

    def _forget_regions(self, peer: str) -> None:
        """A batch to `peer` failed: its regions may be gone or moved; ask for them again."""
        with self._lock:
            remote = self._peers.get(peer)
        if remote is not None:
            with remote.answered:
                remote.regions.clear()

    def _notify(self, agent: str, notification: Notification) -> None:
        with self._lock:
            self._agent.send_notif(agent, encode(notification))

    # -- inbound and completions ----------------------------------------------------------------

    def _poll_loop(self) -> None:
        while not self._closed.is_set():
            try:
                moved = self._poll_once()
            except Exception:  # noqa: BLE001 -- keep polling: one bad notification must not stop the transport
                log.exception("nixl: polling failed")
                moved = False
            if not moved:
                time.sleep(self._nixl.poll_idle_s)

    def _poll_once(self) -> bool:
        with self._lock:
            notifications = self._agent.get_new_notifs()
            finished = []
            for t in self._transfers:
                state = "ERR" if t.batch.done() else self._agent.check_xfer_state(t.handle)
                if state != "PROC":
                    finished.append((t, state))
            for t, _ in finished:
                self._transfers.remove(t)
                _quietly(self._agent.release_xfer_handle, t.handle)
        for t, state in finished:
            self._finished(t, state)
        for agent, messages in notifications.items():
            for raw in messages:
                self._on_notification(agent, raw)
        return bool(finished or notifications)

    def _finished(self, t: _Transfer, state: str) -> None:
        if state != "DONE":
            with self._lock:
                self._acks.pop(t.seq, None)
            self._forget_regions(t.peer)
            t.batch.complete(TransferError(f"nixl transfer with {t.peer!r} failed (state {state})"))
            return
        self._stats.moved(**({"sent": t.nbytes} if t.direction is Direction.WRITE else {"received": t.nbytes}))
        if t.seq is None:
            t.batch.complete()
            return
        with self._lock:
            t.done = True
            acked = t.seq not in self._acks  # the ack overtook the completion
        if acked:
            t.batch.complete(t.ack_error)

    def _on_notification(self, agent: str, raw: bytes) -> None:
        try:
            n = decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("nixl: dropped a notification from agent %s that is not ours: %s", agent, exc)
            return
        if isinstance(n, Want):
            self._load(n.metadata)
            found, missing, descs = [], [], []
            for name in n.names:
                try:
                    region = self._register(name)
                except TransferError:
                    missing.append(name)
                    continue
                found.append((name, region.address, region.length, _kind(region), _device_id(region)))
                descs.append((_kind(region), (region.address, region.length, _device_id(region), name)))
            partial = []
            with self._lock:  # the keys of just these regions; the connection is in our full metadata
                for kind in sorted({k for k, _ in descs}):
                    partial.append(self._agent.get_partial_agent_metadata(
                        self._agent.get_reg_descs([d for k, d in descs if k == kind], kind)))
            self._notify(agent, Regions(partial, found, missing))
        elif isinstance(n, Regions):
            for metadata in n.metadata:
                self._load(metadata)
            with self._lock:
                remote = next((p for p in self._peers.values() if p.agent == agent), None)
            if remote is not None:
                with remote.answered:
                    remote.regions.update({r[0]: tuple(r[1:]) for r in n.regions})
                    remote.missing = list(n.missing)
                    remote.answered.notify_all()
        elif isinstance(n, Notice):  # verifying hashes the slices: off the thread that drives progress
            self._verifier.submit(self._verify, agent, n)
        elif isinstance(n, Ack):
            with self._lock:
                t = self._acks.pop(n.seq, None)
            if t is not None:
                error = TransferError(f"peer {t.peer!r} refused the batch: {n.error}") if n.error else None
                if error is not None:
                    self._forget_regions(t.peer)
                if t.done:
                    t.batch.complete(error)
                else:
                    t.ack_error = error  # the transfer's completion, still to come, completes it
        elif isinstance(n, Message):
            self._stats.moved(received=len(n.payload))
            self._deliver.message(n.sender, n.payload)

    def _verify(self, agent: str, n: Notice) -> None:
        slices = [Slice(*s) for s in n.slices]
        self._stats.moved(received=sum(s.length for s in slices))
        try:
            error = self._deliver.slices_landed(n.sender, slices, OutgoingMessage(n.payload, tuple(n.checksums)))
        except Exception as exc:  # noqa: BLE001 -- the sender must hear of it, not time out
            error = f"the receiver failed: {exc}"
        self._notify(agent, Ack(n.seq, error))


def _address(peer: PeerInfo) -> Address | None:
    text = peer.transports.get("nixl")
    if text is None:
        return None
    try:
        return msgspec.json.decode(text, type=Address)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _kind(region: Region) -> str:
    return "DRAM" if region.device == "cpu" else "VRAM"


def _device_id(region: Region) -> int:
    return int(region.device.partition(":")[2] or 0) if region.device != "cpu" else 0


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 -- teardown: nothing left to tell
        log.debug("nixl: %s%r failed during cleanup: %s", getattr(call, "__name__", call), args, exc)
