"""Log setup shared by every process: one format, and no line per internal poll.

A running cluster polls itself several times a second (heartbeats, load reports, KV events,
health checks). Logged at INFO those lines bury the ones an operator wants (requests, worker
state changes, errors), so httpx's per-request lines are dropped below WARNING and the access
log leaves out the polling routes. Set MOONCAKE_ACCESS_LOG=all to see every route again.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_PREFIXES = ("/internal/", "/health", "/metrics")


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=FORMAT)
    for name in ("httpx", "httpcore", "httpx2"):  # one INFO line per outgoing request, polls included
        # (httpx2: the name the openai SDK's own copy of httpx logs under, in its 3.x releases)
        logging.getLogger(name).setLevel(logging.WARNING)


class QuietPollingFilter(logging.Filter):
    """Drops uvicorn access lines for the routes that are polled (see QUIET_PREFIXES)."""

    def __init__(self, prefixes: tuple[str, ...] = QUIET_PREFIXES) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client address, method, full path, http version, status)
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return not args[2].startswith(self.prefixes)
        return True


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging config with the polling filter on its access log."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    if os.environ.get("MOONCAKE_ACCESS_LOG", "").lower() != "all":
        config.setdefault("filters", {})["quiet_polling"] = {"()": QuietPollingFilter}
        config["handlers"]["access"]["filters"] = ["quiet_polling"]
    return config
