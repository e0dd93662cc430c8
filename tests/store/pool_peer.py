"""A pool in its own process, for the remote tests: `python -m tests.store.pool_peer BB N KEYS...`.

Configures a PoolService of N DRAM blocks of BB bytes, stores each key with the block
`block_data(key, BB)`, prints its messenger PeerInfo (msgspec JSON) on a line that starts with
MARK, then serves until its stdin closes.
"""

from __future__ import annotations

import sys

import msgspec
import numpy as np

from messenger.engine import EngineConfig
from store.config import PoolConfig
from store.service import PoolService

LAYOUT = "remote-test"
MARK = "POOL-PEER "
# shm and tcp only: NIXL, where installed, takes a second to start and adds nothing to these tests.
ENGINE = EngineConfig(transports=("shm", "tcp"), checksums=False)


def block_data(key: int, block_bytes: int) -> np.ndarray:
    return np.random.default_rng(key % 2**64).integers(0, 256, block_bytes, dtype=np.uint8)


def main() -> None:
    block_bytes, blocks, keys = int(sys.argv[1]), int(sys.argv[2]), [int(k) for k in sys.argv[3:]]
    service = PoolService(PoolConfig(dram_bytes=blocks * block_bytes, ssd_dir=None), engine_config=ENGINE).start()
    service.configure(block_bytes, LAYOUT)
    for key, slot in service.reserve(keys):
        service.arena.slot(slot)[:] = block_data(key, block_bytes)
    service.commit(keys)
    # A marked line: libraries the messenger loads (NIXL) print to stdout too.
    print(MARK + msgspec.json.encode(service.peer_info()).decode(), flush=True)
    sys.stdin.read()
    service.close()


if __name__ == "__main__":
    main()
