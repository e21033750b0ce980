"""titans.hf: AutoModelForCausalLM loads what TitansLM saves (and back), generate runs through the recurrent state
and gives TitansLM.generate's tokens, the config's format version, and `import titans` staying free of transformers.
Offline: every model is built here and saved under tmp_path."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import titans.hf  # noqa: E402, F401  (registers the auto classes)
from titans import TitansConfig, TitansLM  # noqa: E402
from titans.hf import TitansCache, TitansForCausalLM, TitansHFConfig  # noqa: E402
from titans.io.pretrained import FORMAT_VERSION  # noqa: E402
from titans.models.config import FLAT_MEMORY_FIELDS  # noqa: E402

AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM
TINY = dict(vocab_size=32, dim=16, depth=2, heads=2, chunk_size=4, segment_len=8, window=8, memory_expansion=2,
            n_persistent=2)
pytestmark = pytest.mark.usefixtures("one_thread")


def saved(tmp_path, variant, dtype=torch.float64, **overrides):
    """A TitansLM in eval mode and the directory it was saved to."""
    model = TitansLM(TitansConfig(variant=variant, **{**TINY, **overrides})).to(dtype).eval()
    model.save_pretrained(tmp_path / variant)
    return model, tmp_path / variant


def tokens(batch, length, seed=1):
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", ["lmm", "mac", "transformer", "mag", "mal", "swa", "lstm", "gated_deltanet"])
def test_auto_model_loads_a_saved_model_with_its_logits(tmp_path, variant):
    model, directory = saved(tmp_path, variant)
    hf = AutoModelForCausalLM.from_pretrained(directory)
    assert isinstance(hf, TitansForCausalLM) and isinstance(AutoConfig.from_pretrained(directory), TitansHFConfig)
    assert hf.config.titans_config == model.config and hf.dtype == torch.float64 and not hf.training
    assert hf.state_dict().keys() == model.state_dict().keys()  # TitansLM's parameter names: one weights file
    x = tokens(2, 13)
    # Not bit-equal: transformers maps the weights from the file unaligned, and BLAS sums in another order then.
    torch.testing.assert_close(hf(x).logits, model(x)[0], rtol=0, atol=1e-12)
    out = hf(x[:, :9])  # the state continues the stream, as TitansLM's does
    torch.testing.assert_close(hf(x[:, 9:], past_key_values=out.past_key_values).logits, model(x)[0][:, 9:],
                               rtol=0, atol=1e-12)
    assert out.past_key_values.get_seq_length() == 9


@pytest.mark.parametrize("variant", ["lmm", "mac", "transformer"])
def test_greedy_generate_matches_titans_generate_one_token_a_step(tmp_path, variant):
    model, directory = saved(tmp_path, variant)
    hf = AutoModelForCausalLM.from_pretrained(directory)
    steps = []  # (tokens fed, state carried) of each forward call generate makes
    forward = hf.forward

    @functools.wraps(forward)  # generate reads the signature (whether it takes attention_mask)
    def recording(*args, **kwargs):
        steps.append((kwargs["input_ids"].shape[1], type(kwargs.get("past_key_values")).__name__))
        return forward(*args, **kwargs)

    hf.forward = recording
    prompt = tokens(2, 11)
    out = hf.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, model.generate(prompt, 12, temperature=0))
    assert steps == [(11, "NoneType")] + [(1, "TitansCache")] * 11  # the prompt once, then only each new token

    # A cache handed back continues the stream: generate feeds only the tokens it has not read.
    first = hf.generate(prompt, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    cache = first.past_key_values
    assert isinstance(cache, TitansCache) and cache.get_seq_length() == 11  # the new token is not read yet
    steps.clear()
    resumed = hf.generate(first.sequences, past_key_values=cache, max_new_tokens=11, do_sample=False)
    assert torch.equal(resumed, out) and steps[0] == (1, "TitansCache")


def test_sampling_and_training_through_the_hf_model(tmp_path):
    _, directory = saved(tmp_path, "mag", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(directory)
    prompt = tokens(1, 5)
    torch.manual_seed(3)
    one = hf.generate(prompt, max_new_tokens=6, do_sample=True, top_k=5)
    torch.manual_seed(3)
    assert one.shape == (1, 11) and torch.equal(one, hf.generate(prompt, max_new_tokens=6, do_sample=True, top_k=5))
    hf.train()
    x = tokens(2, 16)
    loss = hf(x, labels=x).loss
    logits = hf(x).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert hf.embed.weight.grad is not None


def test_hf_save_pretrained_loads_in_titans_lm(tmp_path):
    """What transformers writes (its own config keys, generation_config.json) TitansLM reads too; untied heads and
    constant gates (a buffer transformers leaves empty, refilled from the config) survive both ways."""
    model, directory = saved(tmp_path, "mag", dtype=torch.float32, tie_embeddings=False, memory_gates="constant")
    hf = AutoModelForCausalLM.from_pretrained(directory)
    assert hf.head.weight is not hf.embed.weight
    x = tokens(1, 10)
    torch.testing.assert_close(hf(x).logits, model(x)[0], rtol=0, atol=1e-6)
    hf.save_pretrained(tmp_path / "from_hf")
    again = TitansLM.from_pretrained(tmp_path / "from_hf")
    assert again.config == model.config
    torch.testing.assert_close(again(x)[0], model(x)[0], rtol=0, atol=1e-6)
    fresh = TitansForCausalLM(TitansHFConfig(variant="lmm", **TINY))  # built directly: TitansLM's own init
    assert fresh.config.titans_config == TitansConfig(variant="lmm", **TINY)
    assert fresh.head.weight is fresh.embed.weight and fresh.config.hidden_size == TINY["dim"]


def test_format_version(tmp_path):
    """A config.json lacking a field newer than its version loads with the default; a newer version is refused
    by both loaders with a message saying to upgrade; so is another model_type."""
    _, directory = saved(tmp_path, "lmm", memory_hidden_step=1.0)
    config_path = directory / "config.json"
    data = json.loads(config_path.read_text())
    assert data["titans_format_version"] == FORMAT_VERSION and data["model_type"] == "titans"
    del data["titans"]["memory"]["hidden_step"]  # as if written before the field existed
    config_path.write_text(json.dumps(data))
    for loaded in (TitansLM.from_pretrained(directory).config,
                   AutoModelForCausalLM.from_pretrained(directory).config.titans_config):
        assert loaded.memory.hidden_step == TitansConfig().memory.hidden_step
    # version 1 wrote the memory's fields flat: both loaders read them into the section (and a keyword, flat or
    # nested, changes the loaded config as the file's own field would)
    section = {key: value for key, value in data["titans"].items() if key != "memory"}
    flat = {old: data["titans"]["memory"][new] for old, new in FLAT_MEMORY_FIELDS.items()
            if new in data["titans"]["memory"]}
    config_path.write_text(json.dumps({**data, "titans_format_version": 1, "titans": {**section, **flat}}))
    expected = TitansLM.from_pretrained(directory).config
    assert expected.memory.hidden_step == 1.0 and expected.memory.chunk_size == TINY["chunk_size"]
    assert AutoModelForCausalLM.from_pretrained(directory).config.titans_config == expected
    hf_config = TitansHFConfig(titans=json.loads(config_path.read_text())["titans"], titans_format_version=1,
                               memory_depth=1, memory={"expansion": 2})
    assert (hf_config.titans_config.memory.depth, hf_config.titans_config.memory.expansion) == (1, 2)
    assert hf_config.titans_format_version == FORMAT_VERSION and "memory_depth" not in hf_config.titans
    config_path.write_text(json.dumps(data))

    config_path.write_text(json.dumps({**data, "titans_format_version": FORMAT_VERSION + 1}))
    with pytest.raises(ValueError, match=f"format version {FORMAT_VERSION + 1}, newer than this library reads "
                                         f"\\({FORMAT_VERSION}\\); upgrade titans"):
        TitansLM.from_pretrained(directory)
    with pytest.raises(ValueError, match="upgrade titans"):
        AutoModelForCausalLM.from_pretrained(directory)
    config_path.write_text(json.dumps({**data, "titans": {**data["titans"], "dimm": 3}}))
    with pytest.raises(ValueError, match="dimm: unknown field for TitansConfig"):
        TitansLM.from_pretrained(directory)
    config_path.write_text(json.dumps({**data, "model_type": "llama"}))
    with pytest.raises(ValueError, match="not a titans model"):
        TitansLM.from_pretrained(directory)
    # The flat layout of models saved before config.json had a format version still loads in TitansLM.
    config_path.write_text(json.dumps(data["titans"]))
    assert TitansLM.from_pretrained(directory).config.variant == "lmm"


def test_unsupported_generation_is_refused(tmp_path):
    _, directory = saved(tmp_path, "lmm")
    hf = AutoModelForCausalLM.from_pretrained(directory)
    prompt = tokens(2, 6)
    with pytest.raises(ValueError, match="padding"):
        hf.generate(prompt, attention_mask=torch.tensor([[0] + [1] * 5, [1] * 6]), max_new_tokens=2)
    with pytest.raises(ValueError, match="beam search"):
        hf.generate(prompt, num_beams=2, max_new_tokens=3, do_sample=False)


def test_import_titans_does_not_import_transformers():
    code = "import sys, titans, titans.models, titans.cli; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_without_transformers_the_error_names_the_extra():
    # sys.modules[name] = None makes `import name` fail as if it were not installed.
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import titans.hf\nexcept ImportError as err:\n    print(err)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'pip install "titans[hf]"' in result.stdout, result.stdout + result.stderr[-2000:]


def test_exported_training_run_loads_in_auto_model(tmp_path):
    from typer.testing import CliRunner

    from titans.cli import app
    from titans.train.checkpoint import latest_checkpoint, load_checkpoint_config, load_weights

    tiny_run = Path(__file__).parent / "train" / "tiny.yaml"
    run, out = tmp_path / "run", tmp_path / "model"
    runner = CliRunner()
    assert runner.invoke(app, ["train", str(tiny_run), "--out", str(run), "--quiet", "steps=2",
                               "model.variant=mac", "model.segment_len=8"]).exit_code == 0
    result = runner.invoke(app, ["export", str(run), str(out)])
    assert result.exit_code == 0, result.output
    checkpoint = latest_checkpoint(run)
    trained = TitansLM(load_checkpoint_config(checkpoint).model).eval()
    load_weights(checkpoint, trained)
    hf = AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, trained.config.vocab_size, (2, 20))
    torch.testing.assert_close(hf(x).logits, trained(x)[0], rtol=1e-6, atol=1e-6)  # float32 weights
    assert torch.equal(hf.generate(x, max_new_tokens=5, do_sample=False), trained.generate(x, 5, temperature=0))
