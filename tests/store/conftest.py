"""The store tests' shared fixture: a started, configured PoolService (tests/store/service_support.py)."""

import pytest

from tests.store.service_support import service


@pytest.fixture
def svc(tmp_path):
    s = service(tmp_path)
    yield s
    s.close()
