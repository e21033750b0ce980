"""Byte-level scoring and generation (`titans.models.text_eval`, the logic behind `titans.harness`) against direct
computations from the model's own logits and `TitansLM.generate`. Needs no lm_eval: this runs where the `eval` extra
is not installed (CI)."""

import math
import subprocess
import sys

import pytest
import torch

from titans import TitansConfig, TitansLM
from titans.models.text_eval import ByteLevelEvaluator, cut_at_first_stop


@pytest.fixture(scope="module")
def evaluator(saved_byte_lm):
    return ByteLevelEvaluator.from_pretrained(str(saved_byte_lm[0]), device="cpu", piece_len=5)


@pytest.fixture(scope="module")
def model(saved_byte_lm):
    return saved_byte_lm[1]


def direct(model, tokens: list[int], n_scored: int) -> tuple[float, bool]:
    """Log-prob of the last n_scored tokens from one call over the whole sequence, and whether each is the argmax."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([tokens[:-1]]))
    logp = torch.log_softmax(logits[0, -n_scored:].double(), -1)
    target = torch.tensor(tokens[-n_scored:])
    return logp.gather(-1, target[:, None]).sum().item(), bool((logits[0, -n_scored:].argmax(-1) == target).all())


def greedy_continuation(model, context: str, n: int) -> str:
    prompt = torch.tensor([list(context.encode())])
    return bytes(model.generate(prompt, n, temperature=0)[0, prompt.shape[1]:].tolist()).decode()


def test_loaded_as_saved(evaluator, saved_byte_lm):
    directory, model = saved_byte_lm
    assert evaluator.piece_len == 5 and evaluator.model.embed.weight.dtype == torch.float64
    assert torch.equal(evaluator.model.head.weight, model.head.weight)
    as_float32 = ByteLevelEvaluator.from_pretrained(str(directory), device="cpu", dtype="float32")
    assert as_float32.model.head.weight.dtype == torch.float32


def test_loglikelihood_matches_logits(evaluator, model):
    pairs = [("The sky is", " blue"), ("Two plus two is", " four, café"), ("x", "")]
    results = evaluator.loglikelihood(pairs)
    for (context, continuation), (logprob, _) in zip(pairs[:2], results):
        ctx, cont = list(context.encode()), list(continuation.encode())  # UTF-8 bytes: é is two
        assert len(ctx + cont) > 2 * evaluator.piece_len  # read in several pieces
        assert logprob == pytest.approx(direct(model, ctx + cont, len(cont))[0], rel=1e-12, abs=1e-12)
        assert logprob < 0
    assert results[2] == (0.0, True)  # an empty continuation
    # an empty context conditions on the newline prefix
    (logprob, _), = evaluator.loglikelihood([("", "hi")])
    assert logprob == pytest.approx(direct(model, list(b"\nhi"), 2)[0], rel=1e-12)


def test_is_greedy(evaluator, model):
    context = "Greedy: "
    greedy = greedy_continuation(model, context, 6).encode()
    assert greedy.isascii() and len(set(greedy)) > 1
    (logprob, is_greedy), = evaluator.loglikelihood([(context, greedy.decode())])
    assert is_greedy
    for at in (0, 5):  # one byte off, first or last: not greedy, and less likely
        other = bytearray(greedy)
        other[at] = ord("a") if other[at] != ord("a") else ord("b")
        (other_logprob, other_greedy), = evaluator.loglikelihood([(context, other.decode())])
        assert not other_greedy and other_logprob < logprob


def test_rolling_equals_one_call(evaluator, model):
    text = "A neural long-term memory, read byte by byte: ünïcödé too." * 2
    (rolled,) = evaluator.loglikelihood_rolling([text])
    body = list(text.encode())
    assert len(body) > 5 * evaluator.piece_len  # read in many pieces
    assert rolled == pytest.approx(direct(model, [10] + body, len(body))[0], rel=1e-12)
    whole = ByteLevelEvaluator(model, piece_len=10_000)
    assert whole.loglikelihood_rolling([text])[0] == pytest.approx(rolled, rel=1e-12)
    assert evaluator.loglikelihood_rolling([""]) == [0.0]


def test_generate_until(evaluator, model):
    context = "Once upon a time"
    greedy = greedy_continuation(model, context, 12)
    assert greedy.isascii() and len(set(greedy)) > 4
    (free,) = evaluator.generate_until([(context, {"max_gen_toks": 12})])
    assert free == greedy
    # stop at the earliest occurrence of any stop string, cut off (the later-listed one may occur first in the text)
    early, late = greedy[3:5], greedy[7:9]
    calls = []
    hook = evaluator.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        (cut,) = evaluator.generate_until([(context, {"until": [late, "never", early], "max_gen_toks": 12,
                                                      "do_sample": False})])
    finally:
        hook.remove()
    end, first = min((greedy.find(stop) + len(stop), stop) for stop in (late, early))  # where the first one completes
    assert cut == greedy[:end - len(first)] and len(cut) <= 3
    # generation stops once the stop string is complete: the context's pieces, then one call per byte before the last
    assert len(calls) == math.ceil(len(context) / evaluator.piece_len) + end - 1
    short, none = evaluator.generate_until([(context, {"until": "never", "max_gen_toks": 4}),
                                            (context, {"max_gen_toks": 0})])
    assert short == greedy[:4] and none == ""


def test_sampling_draws_as_generate_does(model):
    """do_sample: the same draws as `TitansLM.generate` with the same sampler arguments and seed."""
    context, options = "Sample: ", dict(temperature=0.8, top_k=40, top_p=0.95)
    sampler = ByteLevelEvaluator(model, piece_len=3, seed=7)
    (sampled,) = sampler.generate_until([(context, {"do_sample": True, "max_gen_toks": 16, **options})])
    prompt = torch.tensor([list(context.encode())])
    expected = model.generate(prompt, 16, generator=torch.Generator().manual_seed(7), **options)
    assert sampled == bytes(expected[0, prompt.shape[1]:].tolist()).decode("utf-8", errors="replace")
    assert sampled != greedy_continuation(model, context, 16)  # it did sample


def test_cut_at_first_stop_on_constructed_output():
    assert cut_at_first_stop(b"abc\n\ndef", [b"\n\n", b"c"]) == b"ab"
    assert cut_at_first_stop(b"abcdef", [b"x"]) == b"abcdef"
    assert cut_at_first_stop(b"abcdef", []) == b"abcdef"


def test_max_length_keeps_the_context_tail(model):
    short = ByteLevelEvaluator(model, max_length=3)
    (logprob, _), = short.loglikelihood([("abcdef", "gh")])
    assert logprob == pytest.approx(direct(model, list(b"defgh"), 2)[0], rel=1e-12)
    # the tail is what generation reads too
    assert short.generate_until([("xyz" * 5 + "Once", {"max_gen_toks": 5})]) == \
        [greedy_continuation(model, "nce", 5)]


@pytest.mark.parametrize("options, message", [
    (dict(max_length=0), "max_length must be an integer >= 1"),
    (dict(piece_len=0), "piece_len must be an integer >= 1"),
    (dict(piece_len="five"), "piece_len must be an integer >= 1"),
    (dict(piece_len=2.5), "piece_len must be an integer >= 1"),
    (dict(prefix=""), "prefix must be a non-empty string"),
    (dict(seed=-1), "seed must be an integer >= 0"),
])
def test_bad_arguments(model, options, message):
    with pytest.raises(ValueError, match=message):
        ByteLevelEvaluator(model, **options)


def test_text_integers_accepted(model):
    """lm-eval's `model_args` string may hand numbers over as text."""
    evaluator = ByteLevelEvaluator(model, max_length="7", piece_len="3")
    assert (evaluator.max_length, evaluator.piece_len) == (7, 3)


def test_bad_models_and_loading(saved_byte_lm):
    directory = str(saved_byte_lm[0])
    with pytest.raises(ValueError, match="reads bytes .vocab 256.; this model has vocab 300"):
        ByteLevelEvaluator(TitansLM(TitansConfig(variant="lmm", vocab_size=300, dim=16, depth=1, heads=2)))
    with pytest.raises(ValueError, match="model must be a TitansLM"):
        ByteLevelEvaluator(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not a saved model"):
        ByteLevelEvaluator.from_pretrained(directory + "/nowhere", device="cpu")
    with pytest.raises(ValueError, match="dtype must name a floating torch dtype"):
        ByteLevelEvaluator.from_pretrained(directory, device="cpu", dtype="int64")
    with pytest.raises(ValueError, match="dtype must name a floating torch dtype"):
        ByteLevelEvaluator.from_pretrained(directory, device="cpu", dtype="float31")
    with pytest.raises(ValueError, match="device must name a torch device"):
        ByteLevelEvaluator.from_pretrained(directory, device="toaster")


@pytest.mark.parametrize("gen_kwargs, message", [
    ({"num_beams": 2}, "unsupported generation arguments .'num_beams'."),
    ({"until": 5}, "until must be a string or a list of strings"),
    ({"until": ["\n", None]}, "until must be a string or a list of strings"),
    ({"do_sample": "yes"}, "do_sample must be true or false"),
    ({"max_gen_toks": -1}, "max_gen_toks must be an integer >= 0"),
    ({"do_sample": True, "temperature": -1.0}, "temperature must be a finite number >= 0"),
    ({"top_k": 0}, "top_k must be an integer >= 1"),
])
def test_bad_generation_arguments(evaluator, gen_kwargs, message):
    with pytest.raises(ValueError, match=message):
        evaluator.generate_until([("context", gen_kwargs)])


def test_imports_no_lm_eval():
    code = ("import sys; sys.modules['lm_eval'] = None\n"  # an import of lm_eval would now fail
            "import titans.models.text_eval; assert 'titans.harness' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
