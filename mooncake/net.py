"""Small network helpers every process uses."""

from __future__ import annotations

import socket
from typing import Any

from mooncake import defaults


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the OS picks it); whoever binds it next may still lose a race."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def http_server_config(app, host: str, port: int, **kwargs: Any):
    """uvicorn's config for one of our HTTP servers (conductor, workers): idle connections are
    kept open HTTP_KEEP_ALIVE_S, longer than the clients' pools keep them (defaults.py says why)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, timeout_keep_alive=int(defaults.HTTP_KEEP_ALIVE_S), **kwargs)
