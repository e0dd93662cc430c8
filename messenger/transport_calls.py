"""Calls that travel as messages through a peer's transport (messenger/engine.py's fallback when
the peer publishes no call lane, or its lane cannot be reached from here).

Every payload the engine hands a transport starts with a one-byte envelope kind: a batch's
notification (or none), a call request carrying the caller's PeerInfo so the callee can answer
it, or a reply. A request is answered on a small pool of threads of its own (a handler may block;
the transport's receiving thread must not), and its reply goes back as a message through the
transport the callee chose for the caller.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import msgspec

from messenger.api import AttachmentSink, Batch, CallFailed, CallReply, PeerInfo, TimedOut, TransferError

log = logging.getLogger(__name__)

# Envelope kinds (first byte of every payload the engine hands a transport).
NOTIFY, SILENT, CALL, REPLY, REPLY_ERROR, REPLY_ATTACHED = 1, 2, 3, 4, 5, 6
_CALL_HEAD = struct.Struct("!BQI")  # kind, call id, length of the caller's PeerInfo JSON
_REPLY_HEAD = struct.Struct("!BQ")
_BODY_LEN = struct.Struct("!Q")  # a REPLY_ATTACHED: the body's length, then body and attachment
_CALLERS_KEPT = 64  # distinct caller descriptions remembered (a caller's changes when it registers memory)

# (the call's text, its payload, the batch that fails the call if the request is not sent)
SendRequest = Callable[[str, bytes, Batch], None]
# The caller's PeerInfo, the request -> (REPLY or REPLY_ERROR, the reply)
RunCall = Callable[[PeerInfo, bytes], "tuple[int, CallReply]"]
# The caller's name, the reply's payload
SendReply = Callable[[str, bytes], None]


class TransportCalls:
    """Both sides of calls through transports: the caller's pending replies and the callee's
    answers. Thread-safe."""

    def __init__(self, name: str, run_call: RunCall, send_reply: SendReply) -> None:
        self._run_call = run_call
        self._send_reply = send_reply
        self._pending: dict[int, Future] = {}
        # Ids start at random: a restarted caller (same name, new engine) must not take its
        # predecessor's late replies for its own calls. 63 bits: room to count up in the "Q".
        self._ids = itertools.count(secrets.randbits(63))
        self._callers_seen: dict[bytes, PeerInfo] = {}  # callers' encoded PeerInfo, decoded once
        self._answering = ThreadPoolExecutor(4, thread_name_prefix=f"messenger-call-{name}")
        self._closed = False

    def call(self, peer: str, caller: bytes, request: bytes, timeout_s: float, send: SendRequest,
             into: AttachmentSink | None, deadline: float | None = None) -> bytes | bytearray:
        """Send `request` to `peer` with this side's PeerInfo (`caller`, JSON) and wait for its
        reply until `deadline` (time.monotonic(); None: `timeout_s` from now, the call's whole
        timeout as its error says: the engine's deadline may have begun on a lane)."""
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        call_id = next(self._ids)
        reply: Future = Future()
        self._pending[call_id] = reply
        payload = _CALL_HEAD.pack(CALL, call_id, len(caller)) + caller + request
        sent = Batch(len(payload), 0)
        sent.add_done_callback(lambda b: b.error is not None and not reply.done() and _fail(reply, b.error))
        try:
            send(f"call to {peer}", payload, sent)
            body, attachment = reply.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TimedOut(f"call to {peer} got no reply within {timeout_s} s") from None
        finally:
            self._pending.pop(call_id, None)
        if not attachment:
            return body
        if into is None:
            return body + attachment
        views = [memoryview(v).cast("B") for v in into(body, len(attachment))]
        if sum(v.nbytes for v in views) != len(attachment):
            raise TransferError(f"call to {peer}: the buffers for the reply's {len(attachment)} B "
                                f"hold {sum(v.nbytes for v in views)} B")
        offset = 0
        for view in views:
            view[:] = attachment[offset:offset + view.nbytes]
            offset += view.nbytes
        return body

    def caller(self, raw: bytes) -> PeerInfo:
        """A caller's PeerInfo from its JSON (decoded once per distinct description)."""
        caller = self._callers_seen.get(raw)
        if caller is None:
            if len(self._callers_seen) >= _CALLERS_KEPT:
                self._callers_seen.clear()
            caller = self._callers_seen[raw] = msgspec.json.decode(raw, type=PeerInfo)
        return caller

    def message(self, peer: str, payload: bytes) -> None:
        """A call or a reply that arrived from `peer` through a transport."""
        kind = payload[0] if payload else 0
        if kind == CALL:
            _, call_id, info_len = _CALL_HEAD.unpack_from(payload)
            start = _CALL_HEAD.size
            caller = self.caller(bytes(payload[start:start + info_len]))
            request = bytes(payload[start + info_len:])
            self._answering.submit(self._answer, caller, call_id, request)
        elif kind in (REPLY, REPLY_ERROR, REPLY_ATTACHED):
            _, call_id = _REPLY_HEAD.unpack_from(payload)
            future = self._pending.get(call_id)
            body, attachment = bytes(payload[_REPLY_HEAD.size:]), b""
            if kind == REPLY_ATTACHED:
                (length,) = _BODY_LEN.unpack_from(body)
                body, attachment = body[_BODY_LEN.size:_BODY_LEN.size + length], body[_BODY_LEN.size + length:]
            if future is not None and not future.done():
                if kind != REPLY_ERROR:
                    future.set_result((body, attachment))
                else:
                    _fail(future, CallFailed(f"{peer} failed the call: {body.decode(errors='replace')}"))
        else:
            log.warning("dropped a message of unknown kind %d from %s", kind, peer)

    def _answer(self, caller: PeerInfo, call_id: int, request: bytes) -> None:
        kind, reply = self._run_call(caller, request)
        try:  # through a transport the attachment is copied into the message: done at once
            if reply.attachment:
                kind = REPLY_ATTACHED
                body = _BODY_LEN.pack(len(reply.body)) + bytes(reply.body) + b"".join(reply.attachment)
            else:
                body = bytes(reply.body)
        except Exception as exc:  # noqa: BLE001 - a malformed reply: the caller gets the error
            kind, body = REPLY_ERROR, f"{type(exc).__name__}: {exc}".encode()
        finally:
            if reply.done is not None:
                try:
                    reply.done()
                except Exception:  # noqa: BLE001 - the handler's cleanup; the reply still goes
                    log.exception("a call reply's done() failed")
        if self._closed:
            return
        try:
            self._send_reply(caller.name, _REPLY_HEAD.pack(kind, call_id) + body)
        except Exception:
            log.exception("could not answer call %d from %s", call_id, caller.name)

    def close(self, why: str) -> None:
        """Fail the calls still waiting for a reply; answer no more."""
        self._closed = True
        for future in list(self._pending.values()):
            if not future.done():
                _fail(future, TransferError(why))
        self._answering.shutdown(wait=False, cancel_futures=True)


def _fail(future: Future, error: BaseException) -> None:
    with contextlib.suppress(Exception):  # already resolved by the reply that raced it
        future.set_exception(error)
