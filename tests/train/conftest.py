"""Shared by the trainer tests: the tiny config, and one torch thread per test (`one_thread`, tests/conftest.py)."""

from pathlib import Path

import pytest

TINY_CONFIG = Path(__file__).with_name("tiny.yaml")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture
def tiny_config() -> Path:
    return TINY_CONFIG
