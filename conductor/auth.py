"""API keys of the public API: who may call /v1 (and vLLM's /tokenize and /detokenize), and which
models each key may use.

Keys come from `--api-keys-file`, MOONCAKE_API_KEYS (comma-separated, every model) and
`--api-key` (one key, every model). The file holds one key per line, optionally followed by
whitespace and a comma-separated list of the model names it may use (none or `*`: every model);
`#` starts a comment. No key configured: the API is open, as vLLM's is without --api-key.

Clients send `Authorization: Bearer KEY`. A missing or unknown key is a 401 (code
invalid_api_key) before the request body is read; a key asking for a model it may not use is a
403 (code model_not_allowed), and /v1/models lists only the models the key may use.
`/health` and `/metrics` stay open (probes and Prometheus); `/internal/*` takes the cluster
token instead (mooncake/auth.py).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from conductor.errors import APIError
from mooncake.auth import header, send_error

API_KEYS_ENV = "MOONCAKE_API_KEYS"
PUBLIC_PREFIX = "/v1"
TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # vLLM's, outside /v1; a key guards them here too


@dataclass(frozen=True)
class ApiKey:
    key: str = field(repr=False)
    models: frozenset[str] | None = None
    """The model names this key may use; None: every model."""

    def __post_init__(self) -> None:
        if not self.key or any(c.isspace() for c in self.key) or not self.key.isprintable():
            raise ValueError("an API key must be non-empty printable text without spaces")

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


def parse_keys_file(text: str, source: str = "the API keys file") -> tuple[ApiKey, ...]:
    """The keys of a keys file's text (format in the module docstring)."""
    keys = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, *rest = line.split(None, 1)
        names = {n.strip() for n in "".join(rest).split(",") if n.strip()}
        if any(len(n.split()) > 1 for n in names):
            raise ValueError(f"{source}, line {number}: after the key, the models are one comma-separated list")
        keys.append(ApiKey(key, None if not names or "*" in names else frozenset(names)))
    return _unique(keys, source)


def load_api_keys(path: str | None, single: str | None = None,
                  environ: Mapping[str, str] = os.environ) -> tuple[ApiKey, ...]:
    """Every key given to the conductor: the file's, MOONCAKE_API_KEYS', and `single` (--api-key).
    Raises ValueError with the file and line of a bad entry."""
    keys: list[ApiKey] = []
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the API keys file {path}: {exc.strerror}") from None
        keys += parse_keys_file(text, f"API keys file {path}")
    keys += [ApiKey(k.strip()) for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if single:
        keys.append(ApiKey(single))
    return _unique(keys, "the API keys")


def _unique(keys: list[ApiKey], source: str) -> tuple[ApiKey, ...]:
    if len({k.key for k in keys}) != len(keys):
        raise ValueError(f"{source}: a key is listed twice (give each key one line with all its models)")
    return tuple(keys)


def find_key(keys: tuple[ApiKey, ...], authorization: bytes | None) -> ApiKey | None:
    """The key a request's Authorization header carries, or None. Every key is compared, in
    constant time, so the time taken tells nothing about which keys exist."""
    scheme, _, given = (authorization or b"").partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    found = None
    for k in keys:
        if hmac.compare_digest(given.strip(), k.key.encode()) and found is None:
            found = k
    return found


class ApiKeyGuard:
    """ASGI middleware: every /v1, /tokenize and /detokenize request needs a known key (401
    otherwise, before its body is read). The key is left in the request's state for the model check (check_model_access)."""

    def __init__(self, app, keys: tuple[ApiKey, ...]):
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        public = path == PUBLIC_PREFIX or path.startswith(PUBLIC_PREFIX + "/") or path in TOKENIZER_PATHS
        if not self.keys or scope["type"] != "http" or not public:
            return await self.app(scope, receive, send)
        authorization = header(scope, "authorization")
        key = find_key(self.keys, authorization)
        if key is None:
            message = ("Incorrect API key provided." if authorization else
                       "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.")
            return await send_error(send, 401, message, "invalid_api_key")
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


def request_key(request: Request) -> ApiKey | None:
    """The key the request was admitted with (None: the API is open)."""
    return getattr(request.state, "api_key", None)


def may_use(request: Request, model: str) -> bool:
    key = request_key(request)
    return key is None or key.allows(model)


def check_model_access(request: Request, model: str) -> None:
    """403 when the request's key may not use `model`."""
    if not may_use(request, model):
        raise APIError(403, f"This API key is not allowed to use the model `{model}`.", param="model",
                       code="model_not_allowed")
