"""lm-evaluation-harness integration (`titans.harness`): registration, the three request types through the class
(its answers are the byte-level evaluator's, which tests/models/test_byte_eval.py checks against the model's logits
without lm_eval) and the harness's cache fed with them, one `simple_evaluate` run on local task files
(tests/data/lm_eval; nothing downloaded) and the command line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from titans.harness import TitansHarnessLM  # noqa: E402
from titans.models.text_eval import ByteLevelEvaluator  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread, as in tests/models (see `one_thread` in tests/conftest.py): with more, the requests here took
    15 s instead of 1 s on the shared 2-core machine."""


@pytest.fixture(scope="module")
def saved(saved_byte_lm):
    return saved_byte_lm


@pytest.fixture(scope="module")
def lm(saved):
    return get_model("titans").create_from_arg_string(f"pretrained={saved[0]},device=cpu,piece_len=5,max_length=40",
                                                      {"batch_size": 1, "device": None})


def req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


class RecordingCacheHook:
    """Stands in for lm-eval's `CacheHook`: records what the model adds to the cache."""

    def __init__(self):
        self.added = []

    def add_partial(self, request_type, args, result):
        self.added.append((request_type, args, result))


def test_registered_and_loaded(lm, saved):
    assert get_model("titans") is TitansHarnessLM
    evaluator = lm.evaluator
    assert isinstance(lm, TitansHarnessLM) and isinstance(evaluator, ByteLevelEvaluator)
    assert (evaluator.piece_len, evaluator.max_length) == (5, 40)  # model_args as text, passed on as integers
    assert evaluator.model.head.weight.equal(saved[1].head.weight)


def test_requests_answered_by_the_evaluator_and_cached(lm, saved):
    reference = ByteLevelEvaluator(saved[1], piece_len=5, max_length=40)
    pairs = [("The sky is", " blue"), ("", "hi"), ("x", "")]
    texts = ["A neural long-term memory, read byte by byte: ünïcödé too.", ""]
    generations = [("Once upon a time", {"until": ["\n", "e"], "max_gen_toks": 12}), ("Hello", {"max_gen_toks": 3})]
    hook = RecordingCacheHook()
    lm.set_cache_hook(hook)
    answers = [lm.loglikelihood([req("loglikelihood", *pair) for pair in pairs]),
               lm.loglikelihood_rolling([req("loglikelihood_rolling", text) for text in texts]),
               lm.generate_until([req("generate_until", *generation) for generation in generations])]
    expected = [reference.loglikelihood(pairs), reference.loglikelihood_rolling(texts),
                reference.generate_until(generations)]
    assert answers == expected
    assert answers[0][0][0] < 0 and answers[1][0] < 0 and len(answers[2][1]) == 3  # not vacuous
    assert hook.added == ([("loglikelihood", pair, result) for pair, result in zip(pairs, answers[0])]
                          + [("loglikelihood_rolling", (text,), result) for text, result in zip(texts, answers[1])]
                          + [("generate_until", g, result) for g, result in zip(generations, answers[2])])
    with pytest.raises(ValueError, match="unsupported generation arguments"):
        lm.generate_until([req("generate_until", "context", {"num_beams": 2})])


def test_bad_model_args(saved):
    with pytest.raises(ValueError, match="unknown model_args"):
        TitansHarnessLM(pretrained=str(saved[0]), device="cpu", windo=3)
    with pytest.raises(ValueError, match="piece_len must be an integer >= 1"):
        TitansHarnessLM(pretrained=str(saved[0]), device="cpu", piece_len=0)
    with pytest.raises(ValueError, match="not a saved model"):
        TitansHarnessLM(pretrained=str(saved[0].parent / "nowhere"), device="cpu")


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
    # bits per byte from the evaluator's rolling log-probs: every text after the newline prefix
    texts = [json.loads(line)["text"] for line in (DATA / "text.jsonl").read_text(encoding="utf-8").splitlines()]
    nll = -sum(ByteLevelEvaluator(saved[1]).loglikelihood_rolling(texts))
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
