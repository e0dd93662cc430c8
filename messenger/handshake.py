"""Mutual authentication of a messenger connection with a shared key (HMAC-SHA256 challenges).

The client speaks first, so a peer that expects plain frames (or a plain client talking to an
authenticating server) fails at once on the magic instead of both sides waiting:

    client -> server   "MCKA" | version u8 | client nonce (32 B)
    server -> client   server nonce (32 B) | HMAC(key, "server" | client nonce | server nonce)
    client -> server   HMAC(key, "client" | server nonce | client nonce)

Each side proves it holds the key over a nonce the other chose, so neither a recorded exchange
nor the server's own answer can be replayed as the client's proof (the labels differ). Nothing
after the handshake is encrypted: the key keeps strangers from pushing or reading KV, it does
not hide the bytes from someone who can watch the network (use a private network or a tunnel).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from messenger.wire import WireError, recv_exactly

HELLO = b"MCKA"
VERSION = 1
NONCE_BYTES = 32
_MAC_BYTES = hashlib.sha256().digest_size


class HandshakeError(WireError):
    """The peer does not hold the same key, or does not speak the handshake."""


def _mac(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


def client_handshake(sock: socket.socket, key: bytes) -> None:
    """Prove `key` to the server and check that it holds it too. Raises HandshakeError."""
    mine = os.urandom(NONCE_BYTES)
    sock.sendall(HELLO + bytes([VERSION]) + mine)
    try:
        answer = recv_exactly(sock, NONCE_BYTES + _MAC_BYTES)
    except TimeoutError:  # no refusal: the peer is frozen or overloaded (a connection error, not a key's)
        raise TimeoutError("the KV peer did not answer the handshake in time (frozen or overloaded?)") from None
    except OSError as exc:  # WireError included: closed or reset
        raise HandshakeError(f"the KV peer closed the connection during the handshake ({exc}): it runs "
                             f"with another cluster token, or none") from None
    theirs, proof = bytes(answer[:NONCE_BYTES]), bytes(answer[NONCE_BYTES:])
    if not hmac.compare_digest(proof, _mac(key, b"server", mine, theirs)):
        raise HandshakeError("the KV peer does not hold this cluster's token")
    sock.sendall(_mac(key, b"client", theirs, mine))


def server_handshake(sock: socket.socket, key: bytes) -> None:
    """Check the client's proof of `key` and prove it back. Raises HandshakeError (the caller
    closes the connection without reading anything else from it)."""
    hello = recv_exactly(sock, len(HELLO) + 1)
    if bytes(hello[:len(HELLO)]) != HELLO:
        raise HandshakeError("the client did not start the handshake (it runs without a cluster token, "
                             "or is not a mooncake messenger)")
    if hello[len(HELLO)] != VERSION:
        raise HandshakeError(f"unsupported handshake version {hello[len(HELLO)]}")
    theirs = bytes(recv_exactly(sock, NONCE_BYTES))
    mine = os.urandom(NONCE_BYTES)
    sock.sendall(mine + _mac(key, b"server", theirs, mine))
    proof = bytes(recv_exactly(sock, _MAC_BYTES))
    if not hmac.compare_digest(proof, _mac(key, b"client", mine, theirs)):
        raise HandshakeError("the client does not hold this cluster's token")
