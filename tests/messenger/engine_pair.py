"""Two transfer engines in this process, connected over the tcp transport (tests of engine.py and
tcp_transport.py use them; not a conftest, so other transports' tests stay independent)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from messenger.engine import EngineConfig, TransferEngine

REGION_BYTES = 16 << 20


@dataclasses.dataclass
class Pair:
    sender: TransferEngine
    receiver: TransferEngine
    src: np.ndarray
    dst: np.ndarray
    notes: list


def make_pair(config: EngineConfig = EngineConfig(transports=("tcp",)), on_call=None, size=REGION_BYTES) -> Pair:
    sender, receiver = TransferEngine("sender", config), TransferEngine("receiver", config)
    src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    sender.register("src", src)
    receiver.register("dst", dst)
    notes: list = []
    sender.start()
    info = receiver.start(on_notify=lambda peer, message, error: notes.append((peer, message, error)),
                          on_call=on_call)
    assert sender.add_peer(info) == config.transports[0]
    return Pair(sender, receiver, src, dst, notes)


@pytest.fixture
def pair():
    p = make_pair()
    yield p
    p.sender.close()
    p.receiver.close()
