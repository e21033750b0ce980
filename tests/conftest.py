import os

# MKL in its strict reproducible mode, set before torch loads it: by default its float64 results depend on the alignment
# of the buffers (what the process allocated before), so two runs of one computation in different processes can differ
# in the last bit, and tests/memory/test_golden.py compares results to the bit.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

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


def write_corpus(root) -> dict:
    """A small corpus of every kind `titans data prepare` reads, generated (nothing downloaded): 24 text files, a JSON
    Lines file and a Parquet file (when pyarrow is installed), and one document of each kind that is skipped. Returns
    {"root", "documents": the readable texts, "skipped": {reason: count}}."""
    import json

    from titans.tasks.text import generated_text

    root.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(24):
        text = f"# file {i}\n" + generated_text(600 + 97 * i, torch.Generator().manual_seed(i)) + "\nnaïve café ✓\n"
        (root / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    records = []
    for i in range(12):
        text = generated_text(300 + 31 * i, torch.Generator().manual_seed(100 + i))
        records.append(json.dumps({"text": text, "id": i}))
        texts.append(text)
    records += ["{not json", json.dumps({"body": "no text field"}), json.dumps({"text": ""})]
    (root / "records.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")
    (root / "image.bin").write_bytes(bytes(range(256)) * 8)  # binary: NUL bytes
    (root / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))  # not UTF-8
    (root / ".hidden.txt").write_text("never read")
    skipped = {"binary": 1, "undecodable": 1, "malformed": 1, "no_text": 1, "empty": 1}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return {"root": root, "documents": texts, "skipped": skipped}
    rows = [generated_text(200 + 13 * i, torch.Generator().manual_seed(200 + i)) for i in range(10)]
    pq.write_table(pa.table({"text": rows + [None]}), root / "rows.parquet", row_group_size=4)
    skipped["no_text"] += 1
    return {"root": root, "documents": texts + rows, "skipped": skipped}


@pytest.fixture(scope="session")
def token_shards(tmp_path_factory):
    """The corpus of `write_corpus` prepared into token shards (a byte-level BPE of 320 tokens trained on it, a fifth
    of the documents held out): {"dir", "corpus", "metadata"}. For the data, task, CLI and training tests."""
    pytest.importorskip("tokenizers", reason="the data extra (tokenizers) is not installed")
    from titans.data.prepare import PrepareOptions, prepare

    corpus = write_corpus(tmp_path_factory.mktemp("corpus") / "corpus")
    out = tmp_path_factory.mktemp("shards") / "shards"
    metadata = prepare(PrepareOptions(inputs=[str(corpus["root"])], vocab_size=320, val_fraction=0.2), out,
                       workers=1, quiet=True)
    return {"dir": out, "corpus": corpus, "metadata": metadata}
