"""The control channel between a worker shell and its connector (mooncake/control.py)."""

import pytest

from decode.kv_receiver import KVReceiver
from decode.staging import StagingConfig
from messenger.tcp import TcpClient, TcpConfig, TransferError
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


def test_the_kv_socket_takes_no_control_calls():
    receiver = KVReceiver("127.0.0.1", 0, 4, StagingConfig(), TcpConfig())
    receiver._server.start()
    client = TcpClient(TcpConfig())
    try:
        for op in ("stats", "drop"):
            with pytest.raises(TransferError, match="only 'put'"):
                client.request(receiver.address, {"op": op, "transfer_id": "t"})
    finally:
        client.close()
        receiver.shutdown()
