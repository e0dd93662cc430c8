"""Runs one worker process: picks its KV port, builds the app, serves it with uvicorn."""

from __future__ import annotations

import logging
import time

from mooncake.defaults import ENGINE_DIED_EXIT_CODE
from mooncake.net import free_port, http_server_config, listen_socket
from mooncake.control import ControlEndpoint
from mooncake.logs import configure_logging
from mooncake.drain import DrainingServer
from mooncake.engine.app import create_app, drain_worker
from mooncake.engine.config import WorkerConfig




def run_worker(config: WorkerConfig, pool_factory=None) -> int:
    """`pool_factory`: starts the node's KVCache pool service (see create_app). Returns the
    process's exit code: 0 after a shutdown, ENGINE_DIED_EXIT_CODE when the engine died."""
    configure_logging()
    log = logging.getLogger(__name__)
    try:
        http_socket = listen_socket(config.host, config.port)
    except OSError as exc:  # exit code 3, as uvicorn's own: the supervisor says "its port taken?"
        log.error("cannot listen on %s:%d: %s (--host, --port)", config.host, config.port, exc.strerror or exc)
        return 3
    # The conductor must know where to push KV before the engine (which binds it) is up, so
    # the port is chosen here rather than by the engine.
    kv_port = config.kv_port or free_port(config.kv_host)
    log.info("%s worker %s: http %s, kv %s:%d, model %s", config.role, config.instance_id,
             config.http_url, config.public_host, kv_port, config.model)
    # (The base may not import the messenger, whose reachable_host answers this for its listeners.)
    if config.public_host in ("0.0.0.0", "::"):
        # Registered, or answered in /health to a conductor that knows its URL: either way its KV
        # address is published as this, which only processes on this host can use.
        log.warning("this worker publishes %s and KV address %s:%d, which no other host can reach: give "
                    "--advertise-host (the address other hosts reach it at)", config.http_url, config.public_host,
                    kv_port)
    # Events port 0: the worker binds a free one for vLLM's KV events itself, before it builds the
    # engine (mooncake/engine/kv_events.py), so no other process can take it in between.
    app = create_app(config, kv_port, 0, ControlEndpoint.new(), pool_factory)
    server = DrainingServer(http_server_config(app, config.host, config.port, log_level="warning",
                                               timeout_graceful_shutdown=5),
                            drain=lambda: drain_worker(app.state.worker),
                            # Leaving without a drain is leaving all the same: /health says so and
                            # held polls of /internal/kv_events end within a second.
                            on_exit=lambda: app.state.worker.drain.begin(time.monotonic()))

    def engine_died() -> None:  # on the event loop, from the worker's engine watch
        app.state.worker.drain.begin(time.monotonic())  # /health says leaving; held polls end
        server.should_exit = True

    app.state.worker.on_engine_death = engine_died
    with http_socket:
        server.run(sockets=[http_socket])
    return ENGINE_DIED_EXIT_CODE if app.state.worker.engine_died else 0
