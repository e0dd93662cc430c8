"""NIXL (its UCX backend) over TCP or shared memory, as the peer of our transports on the same wire.

Runs in NIXL's own virtualenv (benchmarks/peers/nixl_venv.py), by path, with the UCX settings of
`nixl_venv.ucx_env(wire)` (transfer_bench.py sets them):

    .venvs/peer-nixl/bin/python benchmarks/transfer/nixl_worker.py target --plan JSON
    .venvs/peer-nixl/bin/python benchmarks/transfer/nixl_worker.py initiator --plan JSON --peer JSON

Each side makes an agent with NIXL's default configuration (UCX backend, progress thread on, as
vLLM's NixlConnector makes it) and registers its region. The target publishes its agent metadata;
the initiator adds it, builds one transfer request per (op, slice size, batch slot) before any
timing, and reposts it for every batch (`transfer`), polling `check_xfer_state` every POLL_S.
"""

from __future__ import annotations

import base64
import time

import os

import common  # benchmarks/transfer/common.py: this script's own directory is on sys.path
from nixl_cu12 import _api
from nixl_cu12._api import nixl_agent, nixl_agent_config

POLL_S = 0.0002
PROGRESS_DELAY_ENV = "NIXL_BENCH_PROGRESS_DELAY_US"


def _progress_delay_config(delay_us: int) -> type:
    """nixl_agent.__init__ sets its progress thread's delay to 0 (a spinning thread); this
    config class keeps `delay_us` instead, so the thread sleeps between idle polls."""
    base = _api.nixlBind.nixlAgentConfig

    class DelayedProgressConfig(base):
        pthrDelay = property(lambda self: base.pthrDelay.__get__(self),
                             lambda self, value: base.pthrDelay.__set__(self, max(value, delay_us)))
    return DelayedProgressConfig


def new_agent(name: str, region) -> nixl_agent:
    delay_us = int(os.environ.get(PROGRESS_DELAY_ENV, "0"))
    if delay_us:
        _api.nixlBind.nixlAgentConfig = _progress_delay_config(delay_us)
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(region.ctypes.data, region.nbytes, 0, "")], "DRAM")
    return agent


def main() -> None:
    args = common.worker_args(__doc__.splitlines()[0])
    plan = args.plan
    if args.role == "target":
        region = common.new_region(plan, common.TARGET_SEED)
        agent = new_agent("bench-target", region)
        common.print_json({"ready": {"metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
                                     "address": region.ctypes.data}})
        common.serve_until_done(plan, region)
        return
    region = common.new_region(plan, None)
    agent = new_agent("bench-initiator", region)
    remote_agent = agent.add_remote_agent(base64.b64decode(args.peer["metadata"]))
    local, remote = region.ctypes.data, args.peer["address"]
    handles = {}
    for op in common.OPS:
        for size in plan.slice_sizes:
            for slot in range(plan.inflight):
                offsets = plan.offsets(size, slot)
                local_descs = agent.get_xfer_descs([(local + o, size, 0) for o in offsets], "DRAM")
                remote_descs = agent.get_xfer_descs([(remote + o, size, 0) for o in offsets], "DRAM")
                handles[op, size, slot] = agent.initialize_xfer(op.upper(), local_descs, remote_descs,
                                                                remote_agent)

    def wait(handle) -> None:
        while (state := agent.check_xfer_state(handle)) == "PROC":
            time.sleep(POLL_S)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer failed: {state}")

    def run_round(op: str, size: int, batches: int) -> None:
        def submit(slot: int):
            handle = handles[op, size, slot]
            if agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer could not be posted")
            return handle
        common.pipelined_round(submit, wait, batches, plan.inflight)

    common.measure(plan, args.label, region, run_round)
    for handle in handles.values():
        agent.release_xfer_handle(handle)
    agent.remove_remote_agent(remote_agent)


if __name__ == "__main__":
    main()
