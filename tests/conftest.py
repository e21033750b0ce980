import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter (tests/memory/test_triton.py). The variable must be
# set before triton is first imported, and that can happen long before the kernels' tests (torch imports triton for
# its compiler where triton is installed): so here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n auto`, pyproject's addopts) every worker is a process of its own: its torch threads share the
# cores with the other workers', so each takes its share instead of all of them (n workers x n threads would spin).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


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


@pytest.fixture(scope="session")
def saved_byte_lm(tmp_path_factory):
    """A tiny byte-level MAC `TitansLM` in float64, saved: (its directory, the model). Sharp, varied logits; the bytes
    outside printable ASCII get logit 0, so greedy text is printable ASCII and different bytes follow one another.
    For the byte-level evaluator (tests/models/test_byte_eval.py) and the lm-eval layer over it (test_lm_eval.py)."""
    from titans import TitansConfig, TitansLM

    torch.manual_seed(0)
    config = TitansConfig(variant="mac", vocab_size=256, dim=16, depth=1, heads=2, chunk_size=4, segment_len=8,
                          window=8, n_persistent=2, tie_embeddings=False)
    model = TitansLM(config).to(torch.float64).eval()
    with torch.no_grad():
        model.embed.weight.normal_(0, 1.0)
        model.head.weight.normal_(0, 1.0)
        model.head.weight[:32] = 0
        model.head.weight[127:] = 0
    directory = tmp_path_factory.mktemp("titans") / "model"
    model.save_pretrained(directory)
    return directory, model
