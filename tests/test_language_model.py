"""Text in, text out for a model trained on token shards: `titans generate` reads and prints text through the run's
tokenizer, `titans export` writes the tokenizer beside the weights (AutoTokenizer and AutoModelForCausalLM load a
pair that generates the same text), and the evaluator behind lm-eval scores through the tokenizer."""

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from titans import TitansLM
from titans.cli import app
from titans.models.text_eval import ByteLevelEvaluator, TextEvaluator

pytest.importorskip("tokenizers", reason="the data extra (tokenizers) is not installed")
runner = CliRunner()
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "The old farmer carried"
TINY_MAC = Path(__file__).resolve().parents[1] / "configs" / "recipes" / "tiny" / "mac.yaml"


@pytest.fixture(scope="module")
def run(token_shards, tmp_path_factory):
    """A tiny MAC trained 3 steps on the shards through the command line: its run directory and task's codec."""
    from titans.tasks import get_task

    out = tmp_path_factory.mktemp("lm") / "run"
    result = runner.invoke(app, ["train", str(TINY_MAC), "--out", str(out), "--quiet",
                                 f"task.options.data={token_shards['dir']}", "steps=3", "eval_batches=1",
                                 "eval_batch_size=2", "task.eval_lengths=[128]", "tensorboard=false", "threads=1"])
    assert result.exit_code == 0, result.output
    return out, get_task("lm_tokens", data=str(token_shards["dir"])).text_codec()


def greedy(model, ids, n):
    return model.generate(torch.tensor([ids]), n, temperature=0)[0, len(ids):].tolist()


def test_generate_takes_and_prints_text(run):
    out, codec = run
    result = runner.invoke(app, ["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", "12",
                                 "--temperature", "0"])
    assert result.exit_code == 0, result.output
    from titans.train.loop import load_trained

    model = load_trained(out)[3]
    assert result.stdout.rstrip("\n") == codec.decode(greedy(model, codec.encode(PROMPT), 12))
    assert codec.decode(codec.encode(PROMPT)) == PROMPT


def test_export_loads_as_a_transformers_pair(run, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    import titans.hf  # noqa: F401  (registers the auto classes)

    out, codec = run
    exported = tmp_path / "model"
    assert runner.invoke(app, ["export", str(out), str(exported)]).exit_code == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    eot = codec.eot_id
    assert tokenizer.eos_token_id == eot and model.config.eos_token_id == eot
    ids = tokenizer(PROMPT)["input_ids"]
    assert ids == codec.encode(PROMPT) and tokenizer.decode(ids) == PROMPT
    titans_model = TitansLM.from_pretrained(exported)
    expected = greedy(titans_model, ids, 10)
    generated = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    # transformers stops at the end-of-text token (generation_config's eos); up to there, the same tokens
    stop = expected.index(eot) + 1 if eot in expected else len(expected)
    assert generated[:stop] == expected[:stop] and len(generated) >= stop
    refused = runner.invoke(app, ["export", str(out), str(exported)])
    assert refused.exit_code == 2 and "--force" in refused.stderr


def test_the_evaluator_scores_through_the_tokenizer(run, tmp_path):
    out, codec = run
    exported = tmp_path / "model"
    assert runner.invoke(app, ["export", str(out), str(exported)]).exit_code == 0
    evaluator = TextEvaluator.from_pretrained(str(exported), device="cpu", piece_len=7)
    assert not isinstance(evaluator, ByteLevelEvaluator) and evaluator.prefix == [codec.eot_id]
    model = evaluator.model

    def direct(tokens, n_scored):
        with torch.no_grad():
            logits = model(torch.tensor([tokens[:-1]]))[0][0, -n_scored:].double()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[-n_scored:])[:, None]).sum().item()

    context, continuation = "The old farmer ", "carried a basket of pears."
    (logprob, _), = evaluator.loglikelihood([(context, continuation)])
    # lm-eval's pair encoding: the context's trailing space moves to the continuation, the joined text encoded whole
    whole, head = codec.encode(context + continuation), codec.encode(context.rstrip())
    assert logprob == pytest.approx(direct(whole, len(whole) - len(head)), rel=1e-6)
    text = "A careful engineer measured the stone bridge near the river."
    rolling, = evaluator.loglikelihood_rolling([text])
    tokens = [codec.eot_id] + codec.encode(text)
    assert rolling == pytest.approx(direct(tokens, len(tokens) - 1), rel=1e-6) and rolling < 0
    generated, = evaluator.generate_until([(PROMPT, {"max_gen_toks": 12})])
    assert generated == codec.decode(greedy(model, codec.encode(PROMPT), 12))
    first = generated.strip()[:1]
    if first:  # cut at a stop string: nothing from the stop on
        cut, = evaluator.generate_until([(PROMPT, {"max_gen_toks": 12, "until": [first]})])
        assert first not in cut and generated.startswith(cut)
    with pytest.raises(ValueError, match="prefix is for byte-level models"):
        TextEvaluator.from_pretrained(str(exported), device="cpu", prefix="\n")


def test_a_changed_tokenizer_is_refused_before_export_writes(run, token_shards, tmp_path):
    out, _ = run
    tokenizer_file = token_shards["dir"] / "tokenizer.json"
    original = tokenizer_file.read_text()
    changed = json.loads(original)
    merges = changed["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    try:
        tokenizer_file.write_text(json.dumps(changed))
        result = runner.invoke(app, ["export", str(out), str(tmp_path / "model")])
        assert result.exit_code == 2 and "not the tokenizer the shards were made with" in result.stderr
        assert not (tmp_path / "model").exists()
    finally:
        tokenizer_file.write_text(original)
    assert math.isfinite(json.loads((out / "eval.json").read_text())["results"]["128"]["bits_per_byte"])
