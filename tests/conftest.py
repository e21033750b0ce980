import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run where a GPU is; elsewhere they are skipped, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU: torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    # Every test starts from the same RNG state so failures reproduce.
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """One torch thread for the test. The models under test are tiny: on a shared 2-core machine two threads
    per process spin against other processes (a training step went from 50 ms to 3 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
