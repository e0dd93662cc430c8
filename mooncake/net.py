"""Small network helpers every process uses."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the OS picks it); whoever binds it next may still lose a race."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
