import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every model test runs on one torch thread (see `one_thread` in tests/conftest.py)."""
