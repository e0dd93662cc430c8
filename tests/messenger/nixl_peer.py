"""A NIXL transport in its own process, driven line by line over stdin/stdout (JSON).

Started by tests/messenger/test_nixl_transport.py: it registers "kv" (zeros) and "pool" (bytes
0..255 repeated), prints {"info": its PeerInfo}, then serves commands:
  {"peer": PeerInfo}            remember the test process (to answer its messages)
  {"digest": region}            print {"digest": xxh3-64 of the region}
  {"write": [slices], "to": .}  write to the test process with a checksummed message; print the outcome
  {"exit": true}                close and exit
and prints {"notify": [peer, payload, error]} and {"message": [peer, payload]} as they come,
answering each message "ping" with "pong" (a call's reply, the other way).
"""

from __future__ import annotations

import json
import sys
import threading

import msgspec
import xxhash

from messenger.api import Batch, Direction, OutgoingMessage, PeerInfo, Slice
from messenger.nixl_transport import NixlTransport
from tests.messenger.minimal_engine import Inbound, Regions, checksums


class Settings:
    timeout_s = 10.0


def main() -> None:
    name, size = sys.argv[1], int(sys.argv[2])
    out_lock = threading.Lock()

    def say(obj) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    regions = Regions()
    regions.add("kv", size)
    pool = regions.add("pool", size)
    pool[:] = [i % 256 for i in range(size)] if size < 4096 else (list(range(256)) * (size // 256 + 1))[:size]
    transport = NixlTransport(Settings())
    peers: dict[str, PeerInfo] = {}

    class Echo(Inbound):
        def slices_landed(self, peer, slices, message):
            error = super().slices_landed(peer, slices, message)
            say({"notify": [peer, message.payload.decode() if message else "", error]})
            return error

        def message(self, peer, payload):
            say({"message": [peer, payload.decode()]})
            if payload == b"ping" and peer in peers:
                transport.send_message(peers[peer], b"pong", Batch(0, 0))

    address = transport.start(regions, Echo(regions))
    me = PeerInfo(name, "peer-host", {"nixl": address})
    say({"info": msgspec.json.decode(msgspec.json.encode(me))})
    for line in sys.stdin:
        command = json.loads(line)
        if "peer" in command:
            peer = msgspec.json.decode(json.dumps(command["peer"]).encode(), type=PeerInfo)
            transport.can_reach(me, peer)
            peers[peer.name] = peer
        elif "digest" in command:
            say({"digest": xxhash.xxh3_64_intdigest(regions.arrays[command["digest"]])})
        elif "write" in command:
            slices = [Slice(*s) for s in command["write"]]
            batch = Batch(sum(s.length for s in slices), len(slices))
            transport.submit(peers[command["to"]], Direction.WRITE, slices, batch,
                             OutgoingMessage(b"from the peer", checksums(regions, slices)))
            try:
                batch.wait(10)
                say({"written": None})
            except Exception as exc:  # noqa: BLE001
                say({"written": str(exc)})
        elif "exit" in command:
            break
    transport.close()


if __name__ == "__main__":
    main()
