"""The limits on this machine: a plain memory copy, and raw TCP sockets between two processes.

    python -m benchmarks.transfer.limits_worker initiator --wire memcpy --plan JSON
    python -m benchmarks.transfer.limits_worker target --wire tcp4 --plan JSON
    python -m benchmarks.transfer.limits_worker initiator --wire tcp4 --plan JSON --peer JSON

`memcpy` runs alone (numpy copies of the same slices between two regions of one process; "read"
and "write" differ only in direction). `tcpN` opens N loopback connections; a round sends the
round's slices round-robin over them, straight from and into the regions (`sendall` of a view,
`recv_into` a view: no copy in Python), and each stream ends its share of a round with a
one-byte acknowledgement, so a round is timed until every byte has landed. No framing beyond
one header per stream per round: nothing a transfer engine could do with fewer bytes.
"""

from __future__ import annotations

import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.transfer import common

HEADER = struct.Struct("!cQQ")  # op (b"r" or b"w"), batches in the round, slice size
SOCKET_BUFFER = 4 * common.MiB


def memcpy_round(plan: common.Plan, src: np.ndarray, dst: np.ndarray):
    def run_round(op: str, size: int, batches: int) -> None:
        a, b = (src, dst) if op == "write" else (dst, src)

        def submit(slot: int) -> None:
            for off in plan.offsets(size, slot):
                np.copyto(b[off:off + size], a[off:off + size])

        common.pipelined_round(submit, lambda _: None, batches, plan.inflight)
    return run_round


def stream_slices(plan: common.Plan, size: int, batches: int, stream: int, streams: int):
    """Offsets of this stream's share of a round: global slices stream, stream + N, ..."""
    per_batch = plan.slices_per_batch
    for g in range(stream, batches * per_batch, streams):
        batch, j = divmod(g, per_batch)
        yield plan.offsets(size, batch % plan.inflight)[j]


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed mid-slice")
        view = view[n:]


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def serve_stream(plan: common.Plan, region: memoryview, sock: socket.socket, stream: int, streams: int) -> None:
    """The target's side of one connection: rounds until the initiator closes it."""
    header = bytearray(HEADER.size)
    while True:
        try:
            recv_exact(sock, memoryview(header))
        except ConnectionError:
            return
        op, batches, size = HEADER.unpack(header)
        for off in stream_slices(plan, size, batches, stream, streams):
            if op == b"w":
                recv_exact(sock, region[off:off + size])
            else:
                sock.sendall(region[off:off + size])
        if op == b"w":
            sock.sendall(b"k")


def target(plan: common.Plan, streams: int) -> None:
    region = common.new_region(plan, common.TARGET_SEED)
    listener = socket.create_server(("127.0.0.1", 0))
    common.print_json({"ready": {"port": listener.getsockname()[1]}})
    view = memoryview(region)
    for stream in range(streams):
        sock, _ = listener.accept()
        _tune(sock)
        threading.Thread(target=serve_stream, args=(plan, view, sock, stream, streams), daemon=True).start()
    common.serve_until_done(plan, region)


def initiator(plan: common.Plan, streams: int, port: int, label: str) -> None:
    region = common.new_region(plan, None)
    view = memoryview(region)
    socks = []
    for _ in range(streams):
        sock = socket.create_connection(("127.0.0.1", port))
        _tune(sock)
        socks.append(sock)

    def one_stream(stream: int, op: str, size: int, batches: int) -> None:
        sock = socks[stream]
        sock.sendall(HEADER.pack(op[0].encode(), batches, size))
        for off in stream_slices(plan, size, batches, stream, streams):
            if op == "write":
                sock.sendall(view[off:off + size])
            else:
                recv_exact(sock, view[off:off + size])
        if op == "write":
            recv_exact(sock, memoryview(bytearray(1)))

    with ThreadPoolExecutor(streams) as pool:
        def run_round(op: str, size: int, batches: int) -> None:
            for f in [pool.submit(one_stream, s, op, size, batches) for s in range(streams)]:
                f.result()
        common.measure(plan, label, region, run_round)
    for sock in socks:
        sock.close()


def main() -> None:
    args = common.worker_args(__doc__.splitlines()[0])
    if args.wire == "memcpy":
        src = common.new_region(args.plan, None)
        dst = common.new_region(args.plan, common.TARGET_SEED)
        # "read" copies dst -> src, so src is the initiator-side region measure() checks.
        common.measure(args.plan, args.label, src, memcpy_round(args.plan, src, dst))
        common.print_json({"write_verified": common.writes_landed(args.plan, dst)})
        return
    streams = int(args.wire.removeprefix("tcp"))
    if args.role == "target":
        target(args.plan, streams)
    else:
        initiator(args.plan, streams, args.peer["port"], args.label)


if __name__ == "__main__":
    main()
