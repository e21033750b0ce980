"""Every variant: causality, streaming, cached generation, parameter parity, save/load, bad configs."""

import pytest
import torch

from titans import TitansConfig, TitansLM
from titans.models import VARIANTS, load_state, save_state

DT = torch.float64
VOCAB = 32


def tiny_config(variant: str, **overrides) -> TitansConfig:
    options = dict(variant=variant, vocab_size=VOCAB, dim=16, depth=2, heads=2, window=5, segment_len=6,
                   n_persistent=2, chunk_size=4)
    options.update(overrides)
    return TitansConfig(**options)


def tiny_model(variant: str, **overrides) -> TitansLM:
    torch.manual_seed(0)
    model = TitansLM(tiny_config(variant, **overrides)).to(DT)
    with torch.no_grad():  # gates away from their init so that every memory term matters
        for name, p in model.named_parameters():
            if name.endswith("to_gates.weight"):
                p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    return request.param


def test_causality(variant):
    model = tiny_model(variant)
    tokens = torch.randint(0, VOCAB, (2, 25))
    logits, _ = model(tokens)
    for j in (0, 7, 13, 24):
        changed = tokens.clone()
        changed[:, j] = (changed[:, j] + 5) % VOCAB
        logits2, _ = model(changed)
        assert torch.equal(logits2[:, :j], logits[:, :j]), f"position {j} leaked backwards"
        assert (logits2[:, j:] - logits[:, j:]).abs().max() > 1e-9


@pytest.mark.parametrize("cuts", [[1, 7, 8, 19], [5, 6, 12, 18, 24], list(range(1, 30))])
def test_pieces_with_state_equal_one_call(variant, cuts):
    """Odd piece sizes cross memory chunks (4), MAC segments (6) and the attention window (5)."""
    model = tiny_model(variant)
    tokens = torch.randint(0, VOCAB, (2, 30))
    logits, _ = model(tokens)
    state, pieces = None, []
    bounds = [0, *cuts, 30]
    for a, b in zip(bounds, bounds[1:]):
        piece, state = model(tokens[:, a:b], state)
        pieces.append(piece)
    assert (torch.cat(pieces, 1) - logits).abs().max() <= 1e-10


def test_cached_greedy_generation_equals_full_forward(variant):
    model = tiny_model(variant)
    prompt = torch.randint(0, VOCAB, (2, 9))
    out = model.generate(prompt, max_new_tokens=12, temperature=0.0)
    assert out.shape == (2, 21) and torch.equal(out[:, :9], prompt)
    logits, _ = model(out)
    # each generated token is the argmax of the full forward at the previous position
    assert torch.equal(logits[:, 8:-1].argmax(-1), out[:, 9:])


def state_numel(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if hasattr(obj, "__dataclass_fields__"):
        return sum(state_numel(getattr(obj, name)) for name in obj.__dataclass_fields__)
    if isinstance(obj, (list, tuple)):
        return sum(state_numel(item) for item in obj)
    return 0


def test_state_size_is_bounded(variant):
    """Attention caches stop at the window/segment and memory states are constant: only full
    attention (the Transformer++ baseline) grows with the stream."""
    model = tiny_model(variant)
    prompt = torch.randint(0, VOCAB, (1, 4))
    # 4 + 44 and 4 + 92 tokens: both a multiple of the MAC segment plus the same offset in chunks
    _, short = model.generate(prompt, max_new_tokens=44, temperature=0.0, return_state=True)
    _, long = model.generate(prompt, max_new_tokens=92, temperature=0.0, return_state=True)
    if variant == "transformer":
        assert state_numel(long) > state_numel(short)
    else:
        assert state_numel(long) == state_numel(short)


def test_parameter_counts_are_matched():
    counts = {v: TitansLM(tiny_config(v, dim=64, heads=4)).num_parameters() for v in VARIANTS}
    low, high = min(counts.values()), max(counts.values())
    assert high <= 1.15 * low, counts


def test_memorize_then_query_equals_one_pass():
    model = tiny_model("mac")
    document, query = torch.randint(0, VOCAB, (1, 20)), torch.randint(0, VOCAB, (1, 5))
    state = model.memorize(document)
    logits_q, _ = model(query, state)
    logits_all, _ = model(torch.cat([document, query], 1))
    assert (logits_q - logits_all[:, 20:]).abs().max() <= 1e-10


def test_state_save_load_round_trip(tmp_path, variant):
    model = tiny_model(variant)
    state = model.memorize(torch.randint(0, VOCAB, (2, 11)))
    save_state(state, tmp_path / "state.safetensors")
    loaded = load_state(tmp_path / "state.safetensors")
    query = torch.randint(0, VOCAB, (2, 7))
    assert torch.equal(model(query, state)[0], model(query, loaded)[0])


def test_save_and_load_pretrained(tmp_path):
    model = tiny_model("mag").float()
    model.save_pretrained(tmp_path / "m")
    again = TitansLM.from_pretrained(tmp_path / "m").eval()
    tokens = torch.randint(0, VOCAB, (1, 12))
    assert again.config == model.config
    assert torch.equal(again(tokens)[0], model(tokens)[0])
    other = tmp_path / "other"
    TitansLM(tiny_config("mag", dim=32)).save_pretrained(other)
    (tmp_path / "m" / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="does not match"):
        TitansLM.from_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="missing"):
        TitansLM.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"variant": "rnn"}, "variant"),
        ({"window": 0}, "window"),
        ({"dim": 30, "heads": 4}, "dim"),
        ({"segment_len": 0}, "segment_len"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"max_lr": -1.0}, "max_lr"),
        ({"dropout": 1.5}, "dropout"),
    ],
)
def test_bad_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TitansConfig(**{"variant": "mac", **overrides})
    with pytest.raises(ValueError, match=field):
        TitansConfig.from_dict({"variant": "mac", **overrides})


def test_bad_tokens():
    model = tiny_model("lmm")
    with pytest.raises(ValueError, match="tokens"):
        model(torch.full((1, 3), VOCAB))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(1, 3))


def test_sampling_options():
    model = tiny_model("swa")
    prompt = torch.randint(0, VOCAB, (2, 3))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a = model.generate(prompt, 10, temperature=0.8, top_k=5, top_p=0.9, generator=g1)
    b = model.generate(prompt, 10, temperature=0.8, top_k=5, top_p=0.9, generator=g2)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(prompt, 2, top_p=0.0)
