"""Fixtures of the deploy tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def renderer(tmp_path_factory) -> Path:
    """The chart renderer, built once for this run (CI keeps nothing between runs; this is counted)."""
    from tests.deploy.helm_chart import build_renderer

    try:
        return build_renderer(tmp_path_factory.mktemp("helm-render"))
    except RuntimeError as exc:
        pytest.fail(str(exc))
