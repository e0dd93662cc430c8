"""Our HTTP servers keep an idle connection open longer than the clients' pools keep it.

With uvicorn's default (5 s, the same as httpx's pool expiry) the server could close a pooled
connection just as the client sent a request on it: the request failed with a connection error
before it reached the conductor (seen in benchmarks/goodput.py runs at 1 req/s)."""

import httpx

from mooncake import defaults
from mooncake.bench.runner import connection_error_text
from mooncake.net import http_server_config


def test_servers_outlast_the_clients_idle_expiry():
    config = http_server_config(object(), "127.0.0.1", 0, log_level="warning")
    assert config.timeout_keep_alive == int(defaults.HTTP_KEEP_ALIVE_S)
    # httpx is what the openai package and the conductor's worker client pool with.
    assert config.timeout_keep_alive > httpx.Limits().keepalive_expiry
    assert config.log_level == "warning"  # the caller's settings pass through


def test_each_server_is_built_with_it():
    # The conductor, the workers and `mooncake serve`'s conductor: none builds uvicorn's config itself.
    import inspect

    import mooncake.cli
    import mooncake.engine.runner
    import mooncake.launcher
    for module in (mooncake.cli, mooncake.engine.runner, mooncake.launcher):
        source = inspect.getsource(module)
        assert "http_server_config(" in source and "uvicorn.Config(" not in source, module.__name__


def test_a_connection_error_names_what_the_http_library_raised():
    import openai

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/completions")
    try:
        try:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        except httpx.RemoteProtocolError as inner:
            raise openai.APIConnectionError(request=request) from inner
    except openai.APIConnectionError as exc:
        text = connection_error_text(exc)
    assert text == "APIConnectionError: RemoteProtocolError: Server disconnected without sending a response."
    assert connection_error_text(ValueError("x")) == "ValueError: x"
