"""The cluster token: the shared secret every internal endpoint asks for.

Clients of the public API never hold it. The conductor sends it to the workers' internal API,
the workers send it to the embedded registry, and a key derived from it authenticates each KV
connection between workers (the transfer engine, messenger/). `mooncake serve` generates one for its own
children; a multi-host cluster gives every process the same one (`--cluster-token-file` or
MOONCAKE_CLUSTER_TOKEN). `/health` and `/metrics` stay open for probes and scrapers.

Only the edge (the command line) reads the file or the environment; everything else gets the
token as a value. It is never logged.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from mooncake.http_errors import error_json

TOKEN_ENV = "MOONCAKE_CLUSTER_TOKEN"
TOKEN_HEADER = "X-Mooncake-Cluster-Token"
INTERNAL_PREFIX = "/internal/"
MIN_TOKEN_CHARS = 16
"""A shorter token is refused: it could be guessed from outside."""
NO_TOKEN_HELP = (
    "no cluster token: give every process of the cluster the same secret with --cluster-token-file PATH "
    f"or {TOKEN_ENV} (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))' > token`; "
    "`mooncake serve` makes its own), or pass --insecure-no-cluster-token to let anyone who reaches the "
    "internal ports use them")


class ClusterTokenError(ValueError):
    """The configured token cannot be used (empty, too short, unreadable file)."""


def generate_token() -> str:
    return secrets.token_urlsafe(32)


def load_token(path: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token from `path` (whitespace around it ignored), else from MOONCAKE_CLUSTER_TOKEN,
    else None. Raises ClusterTokenError for an unreadable file or an unusable token."""
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ClusterTokenError(f"cannot read the cluster token file {path}: {exc.strerror}") from None
        source = f"the cluster token file {path}"
    elif environ.get(TOKEN_ENV):
        token, source = environ[TOKEN_ENV].strip(), TOKEN_ENV
    else:
        return None
    # ASCII only: the token travels in an HTTP header, which httpx cannot encode otherwise.
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or any(c.isspace() for c in token) \
            or not token.isprintable():
        raise ClusterTokenError(f"{source} must hold one token of at least {MIN_TOKEN_CHARS} printable "
                                f"ASCII characters without spaces")
    return token


def add_token_arguments(parser: argparse.ArgumentParser, generated: bool = False) -> None:
    """--cluster-token-file, and (where no token is generated) --insecure-no-cluster-token."""
    parser.add_argument("--cluster-token-file", default=None, metavar="PATH",
                        help=f"file holding the cluster's shared secret for internal endpoints (default: "
                             f"{TOKEN_ENV}" + ("; else `serve` generates one for its workers)" if generated else ")"))
    if not generated:
        parser.add_argument("--insecure-no-cluster-token", action="store_true",
                            help="run without a cluster token: anyone who reaches the internal ports "
                                 "(worker API, KV socket, embedded registry) can use them")


def token_from_args(args: argparse.Namespace) -> str | None:
    """The token the command line asks for. None only with --insecure-no-cluster-token (or, for
    `serve`, when it is to generate one). Raises ClusterTokenError with what to do."""
    token = load_token(args.cluster_token_file)
    if token is None and not getattr(args, "insecure_no_cluster_token", True):
        raise ClusterTokenError(NO_TOKEN_HELP)
    if token is not None and getattr(args, "insecure_no_cluster_token", False):
        raise ClusterTokenError("--insecure-no-cluster-token contradicts the cluster token given "
                                f"(--cluster-token-file or {TOKEN_ENV})")
    return token


def token_errors(args: argparse.Namespace) -> list[str]:
    """token_from_args' refusal as a sentence for the command line's check, or nothing (and the
    same for etcd credentials given by halves)."""
    from mooncake.registry.config import EtcdCredentials

    errors = []
    try:
        token_from_args(args)
    except ClusterTokenError as exc:
        errors.append(str(exc))
    try:
        EtcdCredentials.from_env()
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def token_matches(given: str | bytes | None, expected: str) -> bool:
    """Constant-time comparison (a byte-by-byte one would leak the token's prefix by timing)."""
    if given is None:
        return False
    given_bytes = given.encode("latin-1", "replace") if isinstance(given, str) else given
    return hmac.compare_digest(given_bytes, expected.encode())


def token_headers(token: str | None) -> dict[str, str]:
    """The header an internal HTTP client sends (none without a token)."""
    return {TOKEN_HEADER: token} if token else {}


def kv_key(token: str) -> bytes:
    """The key of the KV socket's handshake, derived from the token rather than the token itself.
    It travels in vLLM's configuration (kv_connector_extra_config), which vLLM may print or log:
    whoever reads it cannot call the HTTP internal endpoints, but can use the KV socket (push KV
    into a decode worker, or receive a prefill worker's), so it is as secret as the token there."""
    return hmac.new(token.encode(), b"mooncake kv socket v1", hashlib.sha256).digest()


async def send_error(send, status: int, message: str, code: str | None, param: str | None = None) -> None:
    """Answer an HTTP request from ASGI middleware with an OpenAI-style error; the connection is
    closed after it (the body, if any, was not read)."""
    body = error_json(status, message, code, param)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class ClusterTokenGuard:
    """ASGI middleware: every path under /internal/ needs the cluster token (401 otherwise, before
    the body is read); other paths pass. With `token` None (an insecure cluster) everything passes."""

    def __init__(self, app, token: str | None):
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send):
        if self.token is None or scope["type"] != "http" or not scope["path"].startswith(INTERNAL_PREFIX):
            return await self.app(scope, receive, send)
        if token_matches(header(scope, TOKEN_HEADER), self.token):
            return await self.app(scope, receive, send)
        await send_error(send, 401, f"internal endpoint: send the cluster token in {TOKEN_HEADER}",
                         "invalid_cluster_token")


def header(scope, name: str) -> bytes | None:
    """One request header's raw value from an ASGI scope (None when absent)."""
    wanted = name.lower().encode()
    return next((value for key, value in scope.get("headers") or () if key == wanted), None)
