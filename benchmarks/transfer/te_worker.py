"""Mooncake's Transfer Engine over TCP, as the peer of our tcp transport.

Runs in the peer's own virtualenv (benchmarks/peers/venv.py, where `mooncake` is the transfer
engine, not our package), by path, so the repository root is not on sys.path:

    .venvs/peer-mooncake-te/bin/python benchmarks/transfer/te_worker.py target --plan JSON
    .venvs/peer-mooncake-te/bin/python benchmarks/transfer/te_worker.py initiator --plan JSON --peer JSON

Both sides start an engine with P2P handshake (no metadata server) on protocol "tcp" and
register their region; the initiator submits each batch with `batch_transfer_async_write`
(or `_read`): one call per batch of slices, as vLLM's MooncakeConnector does, and awaits it by
polling `transfer_check_status` every POLL_S. (`get_batch_transfer_status` spins a core and logs
a line per batch; on two cores that halved the peer's throughput, so it is not used.)
"""

from __future__ import annotations

import time

import common  # benchmarks/transfer/common.py: this script's own directory is on sys.path
from mooncake.engine import TransferEngine

HOST = "127.0.0.1"
POLL_S = 0.0002


def start_engine(region) -> tuple[TransferEngine, str]:
    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    if engine.register_memory(region.ctypes.data, region.nbytes) != 0:
        raise RuntimeError("Mooncake TransferEngine.register_memory failed")
    return engine, f"{HOST}:{engine.get_rpc_port()}"


def main() -> None:
    args = common.worker_args(__doc__.splitlines()[0])
    plan = args.plan
    if args.role == "target":
        region = common.new_region(plan, common.TARGET_SEED)
        engine, session = start_engine(region)
        common.print_json({"ready": {"session": session, "address": region.ctypes.data}})
        common.serve_until_done(plan, region)
        return
    region = common.new_region(plan, None)
    engine, _ = start_engine(region)
    session, remote = args.peer["session"], args.peer["address"]
    local = region.ctypes.data
    submit_op = {"write": engine.batch_transfer_async_write, "read": engine.batch_transfer_async_read}

    def wait(batch_id: int) -> None:
        if batch_id < 0:
            raise RuntimeError(f"Mooncake batch submit failed: {batch_id}")
        while (status := engine.transfer_check_status(batch_id)) == 0:
            time.sleep(POLL_S)
        if status != 1:
            raise RuntimeError(f"Mooncake batch {batch_id} failed: {status}")

    def run_round(op: str, size: int, batches: int) -> None:
        def submit(slot: int) -> int:
            offsets = plan.offsets(size, slot)
            return submit_op[op](session, [local + o for o in offsets], [remote + o for o in offsets],
                                 [size] * len(offsets))
        common.pipelined_round(submit, wait, batches, plan.inflight)

    common.measure(plan, args.label, region, run_round)


if __name__ == "__main__":
    main()
