"""lm-evaluation-harness integration (`titans.harness`): the three request types against direct computations from
the model's logits, and one `simple_evaluate` run on local task files (tests/data/lm_eval; nothing downloaded)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from titans import TitansConfig, TitansLM  # noqa: E402
from titans.harness import TitansHarnessLM  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"
TINY = dict(vocab_size=256, dim=16, depth=1, heads=2, chunk_size=4, segment_len=8, window=8, n_persistent=2,
            tie_embeddings=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = TitansLM(TitansConfig(variant="mac", **TINY)).to(torch.float64).eval()
    with torch.no_grad():  # sharp, varied logits; the bytes outside printable ASCII get logit 0, so greedy text
        model.embed.weight.normal_(0, 1.0)  # is printable ASCII and different bytes follow one another
        model.head.weight.normal_(0, 1.0)
        model.head.weight[:32] = 0
        model.head.weight[127:] = 0
    directory = tmp_path_factory.mktemp("titans") / "model"
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def lm(saved):
    return get_model("titans").create_from_arg_string(f"pretrained={saved[0]},device=cpu,piece_len=5",
                                                      {"batch_size": 1, "device": None})


def req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def direct(model, tokens: list[int], n_scored: int) -> tuple[float, bool]:
    """Log-prob of the last n_scored tokens from one call over the whole sequence, and whether each is the argmax."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([tokens[:-1]]))
    logp = torch.log_softmax(logits[0, -n_scored:].double(), -1)
    target = torch.tensor(tokens[-n_scored:])
    return logp.gather(-1, target[:, None]).sum().item(), bool((logits[0, -n_scored:].argmax(-1) == target).all())


def test_registered_and_loaded(lm, saved):
    assert get_model("titans") is TitansHarnessLM
    assert isinstance(lm, TitansHarnessLM) and lm.piece_len == 5 and lm.model.embed.weight.dtype == torch.float64
    assert torch.equal(lm.model.head.weight, saved[1].head.weight)


def test_loglikelihood_matches_logits(lm, saved):
    model = saved[1]
    pairs = [("The sky is", " blue"), ("Two plus two is", " four, café"), ("x", "")]
    results = lm.loglikelihood([req("loglikelihood", c, x) for c, x in pairs])
    for (context, continuation), (logprob, _) in zip(pairs[:2], results):
        ctx, cont = list(context.encode()), list(continuation.encode())  # UTF-8 bytes: é is two
        assert logprob == pytest.approx(direct(model, ctx + cont, len(cont))[0], rel=1e-12, abs=1e-12)
        assert logprob < 0
    assert results[2] == (0.0, True)  # an empty continuation
    # an empty context conditions on the newline prefix
    (logprob, _), = lm.loglikelihood([req("loglikelihood", "", "hi")])
    assert logprob == pytest.approx(direct(model, list(b"\nhi"), 2)[0], rel=1e-12)


def test_is_greedy(lm, saved):
    context = "Greedy: "
    prompt = torch.tensor([list(context.encode())])
    greedy = bytes(saved[1].generate(prompt, 6, temperature=0)[0, prompt.shape[1]:].tolist())
    assert greedy.isascii() and len(set(greedy)) > 1
    (logprob, is_greedy), = lm.loglikelihood([req("loglikelihood", context, greedy.decode())])
    assert is_greedy
    for at in (0, 5):  # one byte off, first or last: not greedy, and less likely
        other = bytearray(greedy)
        other[at] = ord("a") if other[at] != ord("a") else ord("b")
        (other_logprob, other_greedy), = lm.loglikelihood([req("loglikelihood", context, other.decode())])
        assert not other_greedy and other_logprob < logprob


def test_rolling_equals_one_call(lm, saved):
    text = "A neural long-term memory, read byte by byte: ünïcödé too." * 2
    (rolled,) = lm.loglikelihood_rolling([req("loglikelihood_rolling", text)])
    body = list(text.encode())
    assert len(body) > 5 * lm.piece_len  # read in many pieces
    assert rolled == pytest.approx(direct(saved[1], [10] + body, len(body))[0], rel=1e-12)
    whole = TitansHarnessLM(pretrained=str(saved[0]), device="cpu", piece_len=10_000)
    assert whole.loglikelihood_rolling([req("loglikelihood_rolling", text)])[0] == pytest.approx(rolled, rel=1e-12)


def test_generate_until(lm, saved):
    context = "Once upon a time"
    prompt = torch.tensor([list(context.encode())])
    greedy = saved[1].generate(prompt, 12, temperature=0)[0, prompt.shape[1]:].tolist()
    greedy = bytes(greedy).decode()
    assert greedy.isascii() and len(set(greedy)) > 4
    (free,) = lm.generate_until([req("generate_until", context, {"max_gen_toks": 12})])
    assert free == greedy
    # stop at the first occurrence of the earliest stop string, cut off
    early, late = greedy[3:5], greedy[7:9]
    (cut,) = lm.generate_until([req("generate_until", context,
                                    {"until": [late, "never", early], "max_gen_toks": 12, "do_sample": False})])
    assert cut == greedy[:greedy.find(early)] and len(cut) <= 3
    (short,) = lm.generate_until([req("generate_until", context, {"until": "never", "max_gen_toks": 4})])
    assert short == greedy[:4]
    with pytest.raises(ValueError, match="unsupported generation arguments"):
        lm.generate_until([req("generate_until", context, {"num_beams": 2})])


def test_until_cut_on_constructed_output(lm):
    assert lm._cut(b"abc\n\ndef", [b"\n\n", b"c"]) == b"ab"
    assert lm._cut(b"abcdef", [b"x"]) == b"abcdef"


def test_bad_model_args(saved):
    with pytest.raises(ValueError, match="unknown model_args"):
        TitansHarnessLM(pretrained=str(saved[0]), device="cpu", windo=3)
    with pytest.raises(ValueError, match="not a saved model"):
        TitansHarnessLM(pretrained=str(saved[0].parent / "nowhere"), device="cpu")


def test_max_length_keeps_the_context_tail(saved):
    short = TitansHarnessLM(pretrained=str(saved[0]), device="cpu", max_length=3)
    (logprob, _), = short.loglikelihood([req("loglikelihood", "abcdef", "gh")])
    assert logprob == pytest.approx(direct(saved[1], list(b"defgh"), 2)[0], rel=1e-12)


def test_missing_lm_eval_names_the_extra():
    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "try:\n    import titans.harness\nexcept ImportError as e:\n    print(e)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'pip install "titans[eval]"' in result.stdout


def test_import_titans_does_not_import_lm_eval():
    code = "import sys, titans; assert 'lm_eval' not in sys.modules and 'titans.harness' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


TASKS = """\
task: titans_local_choice
dataset_path: json
dataset_kwargs:
  data_files: {{test: "{data}/choice.jsonl"}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
---
task: titans_local_qa
dataset_path: json
dataset_kwargs:
  data_files: {{test: "{data}/qa.jsonl"}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
---
task: titans_local_text
dataset_path: json
dataset_kwargs:
  data_files: {{test: "{data}/text.jsonl"}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
"""


def write_tasks(directory: Path) -> Path:
    """The three task files, with the data files' absolute paths, in `directory`/tasks."""
    (directory / "tasks").mkdir()
    for i, doc in enumerate(TASKS.format(data=DATA.as_posix()).split("---\n")):
        (directory / "tasks" / f"task{i}.yaml").write_text(doc)
    return directory / "tasks"


def test_simple_evaluate_on_local_tasks(saved, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    manager = TaskManager(include_path=str(write_tasks(tmp_path)), include_defaults=False)
    out = lm_eval.simple_evaluate(model="titans", model_args=f"pretrained={saved[0]},device=cpu",
                                  tasks=["titans_local_choice", "titans_local_qa", "titans_local_text"],
                                  task_manager=manager, batch_size=1)
    results = out["results"]
    assert 0 <= results["titans_local_choice"]["acc,none"] <= 1
    assert results["titans_local_qa"]["exact_match,none"] in (0.0, 0.5, 1.0)
    # bits per byte from the model directly: every text after the newline prefix
    texts = [json.loads(line)["text"] for line in (DATA / "text.jsonl").read_text(encoding="utf-8").splitlines()]
    nll = -sum(direct(saved[1], [10] + list(t.encode()), len(t.encode()))[0] for t in texts)
    n_bytes = sum(len(t.encode()) for t in texts)
    assert results["titans_local_text"]["bits_per_byte,none"] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-9)


@pytest.mark.slow  # lm-eval's command line indexes its built-in task files first (~25 s on a 2-core machine)
def test_command_line(saved, tmp_path):
    """`python -m titans.harness` is lm-eval's command line with `--model titans` registered."""
    import titans

    source = str(Path(titans.__file__).resolve().parents[1])  # this titans, whichever way the suite imports it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}
    result = subprocess.run([sys.executable, "-m", "titans.harness", "run", "--model", "titans", "--model_args",
                             f"pretrained={saved[0]}", "--device", "cpu", "--tasks", "titans_local_text",
                             "--include_path", str(write_tasks(tmp_path))],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "titans_local_text" in result.stdout and "bits_per_byte" in result.stdout
