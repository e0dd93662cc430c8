"""Our transfer engine (messenger/engine.py) between two processes, one transport at a time.

    python -m benchmarks.transfer.ours_worker target --wire tcp --plan JSON
    python -m benchmarks.transfer.ours_worker initiator --wire tcp --plan JSON --peer JSON

`--wire` is the transport: tcp, shm, nixl (NIXL's UCX wire then comes from the environment,
benchmarks/peers/nixl_venv.ucx_env). The engine runs with its default configuration but only
that transport, so checksums are on, as shipped. Each batch is one `write()` or `read()` of the
plan's slices; the initiator keeps `inflight` batches submitted and waits on the oldest `Batch`.
Prints `{"unavailable": why}` and exits when the engine or the transport cannot run here.
"""

from __future__ import annotations

import sys

from benchmarks.transfer import common

REGION = "bench"


def _unavailable(why: str) -> None:
    common.print_json({"unavailable": why})
    sys.exit(0)


def main() -> None:
    args = common.worker_args(__doc__.splitlines()[0])
    plan, transport = args.plan, args.wire
    try:
        import msgspec

        from messenger.api import NoTransport, PeerInfo, Slice
        from messenger.engine import EngineConfig, TransferEngine
    except ImportError as e:
        _unavailable(f"messenger.engine does not import: {e}")
    engine = TransferEngine(f"bench-{args.role}", EngineConfig(transports=(transport,)))
    region = common.new_region(plan, common.TARGET_SEED if args.role == "target" else None)
    engine.register(REGION, region)
    try:
        try:
            info = engine.start()
        except NoTransport as e:
            _unavailable(str(e))
        if transport not in info.transports:
            _unavailable(f"our {transport} transport did not start here (engine offers {sorted(info.transports)})")
        if args.role == "target":
            common.print_json({"ready": {"info": msgspec.json.decode(msgspec.json.encode(info))}})
            common.serve_until_done(plan, region)
            return
        peer = msgspec.json.decode(msgspec.json.encode(args.peer["info"]), type=PeerInfo)
        chosen = engine.add_peer(peer)
        if chosen != transport:
            _unavailable(f"the engine chose {chosen!r} for the peer, not {transport!r}")
        submit_op = {"write": engine.write, "read": engine.read}

        def run_round(op: str, size: int, batches: int) -> None:
            def submit(slot: int):
                return submit_op[op](peer.name, [Slice(REGION, o, REGION, o, size) for o in plan.offsets(size, slot)])
            common.pipelined_round(submit, lambda batch: batch.wait(), batches, plan.inflight)

        common.measure(plan, args.label, region, run_round)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
