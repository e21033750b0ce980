import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one thread is fastest, and on a shared 2-core machine two threads per process spin
    against other processes (a training step went from 50 ms to 3 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
