"""The control channel between a worker shell and its connector (mooncake/control.py)."""

import threading
import time

import msgspec
import pytest

from decode.kv_receiver import KVReceiver
from decode.staging import StagingConfig
from messenger.engine import TransferEngine
from mooncake.control import ControlEndpoint, ControlError, ControlServer, control_call


def test_a_call_gets_the_handlers_reply():
    endpoint = ControlEndpoint.new()
    server = ControlServer(endpoint, lambda req: {"ok": True, "echo": req["op"]}).start()
    try:
        assert control_call(endpoint, {"op": "stats"}) == {"ok": True, "echo": "stats"}
        assert control_call(endpoint, {"op": "drop"})["echo"] == "drop"  # one connection per call
    finally:
        server.close()


def test_a_handler_that_raises_still_answers():
    endpoint = ControlEndpoint.new()
    server = ControlServer(endpoint, lambda req: 1 / 0).start()
    try:
        reply = control_call(endpoint, {"op": "stats"})
        assert reply["ok"] is False and "ZeroDivisionError" in reply["error"]
    finally:
        server.close()


def test_a_caller_without_the_key_is_refused():
    endpoint = ControlEndpoint.new()
    server = ControlServer(endpoint, lambda req: {"ok": True}).start()
    try:
        with pytest.raises(ControlError):
            control_call(ControlEndpoint(endpoint.path, "00" * 16), {"op": "stats"})
        assert control_call(endpoint, {"op": "stats"}) == {"ok": True}  # still serving
    finally:
        server.close()


def test_no_connector_is_a_clear_error():
    with pytest.raises(ControlError, match="stats"):
        control_call(ControlEndpoint.new(), {"op": "stats"}, timeout_s=0.5)


def test_a_waiting_call_does_not_hold_up_the_others():
    # push_outcome waits for acknowledgements; stats scrapes must still be answered meanwhile.
    waiting, release = threading.Event(), threading.Event()

    def handler(req):
        if req["op"] == "push_outcome":
            waiting.set()
            release.wait(10)
        return {"ok": True, "op": req["op"]}

    endpoint = ControlEndpoint.new()
    server = ControlServer(endpoint, handler).start()
    try:
        slow = threading.Thread(target=control_call, args=(endpoint, {"op": "push_outcome"}, 15.0))
        slow.start()
        assert waiting.wait(10)  # the slow call is in its handler
        assert control_call(endpoint, {"op": "stats"}, 5.0)["op"] == "stats"  # answered meanwhile
        assert slow.is_alive()
    finally:
        release.set()
        slow.join(15)
        server.close()


def test_the_kv_engine_takes_only_kv_calls():
    engine = TransferEngine("consumer")
    receiver = KVReceiver(engine, 4, StagingConfig(capacity_bytes=1 << 20))
    for op in (b'{"op": "stats"}', b'{"type": "drop", "transfer_id": "t"}', b"not json"):
        with pytest.raises(msgspec.DecodeError):
            receiver.on_call("peer", op)


def test_the_shell_marks_a_prefill_whose_push_did_not_land():
    import asyncio

    from mooncake.engine.app import _with_push_outcome
    from mooncake.protocol import GenerateChunk

    outcomes = {"good": {"ok": True}, "bad": {"ok": False, "error": "ChecksumError: slice 0"}}
    asked = []

    def handler(req):
        asked.append((req["op"], req["transfer_id"], req["timeout_s"]))
        return outcomes[req["transfer_id"]]

    endpoint = ControlEndpoint.new()
    server = ControlServer(endpoint, handler).start()
    last = GenerateChunk([7], finish_reason="length")
    try:
        assert asyncio.run(_with_push_outcome(endpoint, "good", last)) == last
        marked = asyncio.run(_with_push_outcome(endpoint, "bad", last))
        assert marked.kv_error == "ChecksumError: slice 0" and marked.token_ids == [7]
        assert [a[:2] for a in asked] == [("push_outcome", "good"), ("push_outcome", "bad")] and asked[0][2] > 0
    finally:
        server.close()


def test_callers_that_leave_mid_handshake_never_stop_the_control_channel(tmp_path):
    import socket

    server = ControlServer(ControlEndpoint.new(), lambda request: {"ok": True, "echo": request["op"]}).start()
    try:
        for leave_after in (0, 1):
            for _ in range(5):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(server.endpoint.path)
                if leave_after:
                    s.recv(64)
                s.close()
        time.sleep(0.2)
        assert control_call(server.endpoint, {"op": "stats"})["echo"] == "stats"
        with pytest.raises(ControlError):  # and the key is still checked
            control_call(ControlEndpoint(server.endpoint.path, "00" * 16), {"op": "stats"}, timeout_s=1.0)
    finally:
        server.close()
