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


@pytest.fixture
def two_ranks():
    """Run `target(rank, port, *args, queue)` in two spawned processes (a gloo group's ranks 0 and 1 on a free local
    port): each puts (rank, *results) on the queue; returns {rank: results} once both exited cleanly."""
    import socket

    import torch.multiprocessing as mp

    def run(target, *args, timeout: float = 300) -> dict:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=target, args=(rank, port, *args, queue)) for rank in (0, 1)]
        for p in procs:
            p.start()
        results = {rank: rest for rank, *rest in (queue.get(timeout=timeout) for _ in procs)}
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        return results

    return run
