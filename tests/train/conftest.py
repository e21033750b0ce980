"""Shared by the trainer tests: the tiny config, and one torch thread per test process.

One thread because these models are tiny: on a loaded 2-core machine two threads spin against
each other and a step takes 100x longer.
"""

from pathlib import Path

import pytest
import torch

TINY_CONFIG = Path(__file__).with_name("tiny.yaml")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_config() -> Path:
    return TINY_CONFIG
