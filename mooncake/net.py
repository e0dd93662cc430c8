"""Small network helpers every process uses."""

from __future__ import annotations

import socket
from typing import Any

from mooncake import defaults


def url_host(host: str) -> str:
    """`host` as it goes in a URL: an IPv6 address in brackets (http://[fd00::7]:8100)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the OS picks it); whoever binds it next may still lose a race."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_block(n: int) -> int:
    """First of n consecutive ports nobody listens on now (`serve`'s worker ports are
    consecutive from --worker-port); the same race as free_port."""
    for _ in range(50):
        base = free_port()
        if base + n >= 65535:
            continue
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


def host_error(host: str) -> str | None:
    """Why no server can listen on `host` here (a name that does not resolve, an address that is
    not this machine's), or None."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"{host} does not resolve ({exc.strerror})"
    family, _, _, _, address = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind(address)
    except OSError as exc:
        return f"{host} cannot be listened on here ({exc.strerror}): is it an address of this machine?"
    return None


def port_in_use(host: str, port: int) -> bool:
    """Something listens on (host, port) now, or the address cannot be bound (as uvicorn would
    bind it: SO_REUSEADDR on, so a port left in TIME_WAIT counts as free)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False  # a bad host is the server's own error to report
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            return True
    return False


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) for uvicorn to serve on (Server.run(sockets=...)): bound
    before the app's start-up runs, so a port that is taken is said at once, not after the
    start-up (a worker's: the engine's build, a minute) has run for nothing. OSError if it cannot."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def http_server_config(app, host: str, port: int, **kwargs: Any):
    """uvicorn's config for one of our HTTP servers (conductor, workers): idle connections are
    kept open HTTP_KEEP_ALIVE_S, longer than the clients' pools keep them (defaults.py says why)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, timeout_keep_alive=int(defaults.HTTP_KEEP_ALIVE_S), **kwargs)
