"""Round trip of one messenger call (`TransferEngine.call`) between two processes, beside a plain
Python socket ping-pong between two processes on the same machine, in the same run.

    python -m benchmarks.call_latency [--calls 2000] [--reply-bytes 0,65536] [--transports tcp,shm]

A call is how the pool fetches a small block from another node's pool and how a prefill reserves
room on a decode worker: its round trip bounds a single remote get (issue #14). The socket
ping-pong (request out, reply of the same size back, both sides blocking on recv) is what any
Python request/reply pays on this machine, so the ratio is the messenger's own overhead. Rows:
a call on its lane (the default, messenger/call_lane.py), and a call through each transport's
link (`EngineConfig(call_lanes=False)`, how every call went before the lanes).
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import struct
import time

_LEN = struct.Struct("!I")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--calls", type=int, default=2000, help="round trips per row (after 200 warm-up)")
    p.add_argument("--reply-bytes", default="0,65536", help="comma-separated reply sizes")
    p.add_argument("--transports", default="tcp,shm", help="comma-separated: the engine's transport per row")
    return p.parse_args(argv)


def _callee(conn, transports: tuple[str, ...], lanes: bool) -> None:
    """The answering engine: replies with the number of bytes the request asks for."""
    import msgspec

    from messenger.engine import EngineConfig, TransferEngine

    engine = TransferEngine("callee", EngineConfig(transports=transports, call_lanes=lanes))
    replies: dict[int, bytes] = {}

    def on_call(peer: str, request: bytes) -> bytes:
        size = int.from_bytes(request, "big")
        return replies.setdefault(size, bytes(size))

    info = engine.start(on_call=on_call)
    conn.send(msgspec.json.encode(info))
    conn.recv()  # until told to stop
    engine.close()


def engine_round_trips(transport: str, reply_bytes: int, calls: int, lanes: bool) -> list[float]:
    import msgspec

    from messenger.api import PeerInfo
    from messenger.engine import EngineConfig, TransferEngine

    transports = (transport,) if transport == "tcp" else (transport, "tcp")
    here, there = multiprocessing.get_context("spawn").Pipe()
    callee = multiprocessing.get_context("spawn").Process(target=_callee, args=(there, transports, lanes),
                                                        daemon=True)
    callee.start()
    engine = TransferEngine("caller", EngineConfig(transports=transports, call_lanes=lanes))
    try:
        engine.start()
        if not here.poll(60):
            raise RuntimeError("the callee did not start")
        chosen = engine.add_peer(msgspec.json.decode(here.recv(), type=PeerInfo))
        if chosen != transport:
            raise RuntimeError(f"the engine chose {chosen} for a peer on this host, not {transport}")
        request = reply_bytes.to_bytes(4, "big")
        times = []
        for i in range(calls + 200):
            start = time.perf_counter()
            reply = engine.call("callee", request)
            if i >= 200:
                times.append(time.perf_counter() - start)
            assert len(reply) == reply_bytes
        return times
    finally:
        engine.close()
        here.send(b"stop")
        callee.join(10)


def _echo(port_conn) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_conn.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        head = _recv_exactly(conn, _LEN.size)
        if not head:
            return
        size = _LEN.unpack(head)[0]
        conn.sendall(_LEN.pack(size) + bytes(size))


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            return b""
        out += chunk
    return bytes(out)


def socket_round_trips(reply_bytes: int, calls: int) -> list[float]:
    here, there = multiprocessing.get_context("spawn").Pipe()
    echo = multiprocessing.get_context("spawn").Process(target=_echo, args=(there,), daemon=True)
    echo.start()
    try:
        if not here.poll(60):
            raise RuntimeError("the echo server did not start")
        sock = socket.create_connection(("127.0.0.1", here.recv()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for i in range(calls + 200):
            start = time.perf_counter()
            sock.sendall(_LEN.pack(reply_bytes))
            size = _LEN.unpack(_recv_exactly(sock, _LEN.size))[0]
            _recv_exactly(sock, size)
            if i >= 200:
                times.append(time.perf_counter() - start)
        sock.close()
        return times
    finally:
        echo.kill()
        echo.join(10)


def us(times: list[float], q: float) -> float:
    return statistics.quantiles(times, n=100)[int(q) - 1] * 1e6 if q < 100 else max(times) * 1e6


def main(argv=None) -> None:
    args = parse_args(argv)
    print("| reply | what | p50 us | p90 us | p99 us | p50 / socket ping-pong |")
    print("|---|---|---:|---:|---:|---:|")
    for size in [int(s) for s in args.reply_bytes.split(",") if s]:
        base = socket_round_trips(size, args.calls)
        base_p50 = statistics.median(base) * 1e6
        rows = [("Python socket ping-pong (floor)", base)]
        transports = [t for t in args.transports.split(",") if t]
        rows.append(("messenger call, on its lane", engine_round_trips(transports[0], size, args.calls, True)))
        rows += [(f"messenger call, through {t}", engine_round_trips(t, size, args.calls, False)) for t in transports]
        for what, times in rows:
            p50 = statistics.median(times) * 1e6
            print(f"| {size:,} B | {what} | {p50:.0f} | {us(times, 90):.0f} | {us(times, 99):.0f} "
                  f"| {p50 / base_p50:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
