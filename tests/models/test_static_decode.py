"""Static decoding (`models/decode.py`, `generate(decode="static")`): the fixed-shape one-token step gives the tokens
and the state of the dynamic step, for every variant, in float64, across the memory's chunk ends, MAC's segment ends
and the attention window's wrap, from prompts shorter than a chunk and longer than the window. The same step captured
in CUDA graphs (`decode="graph"`) is held to eager CUDA generation in tests/test_cuda.py."""

import pytest
import torch

from titans.layers import trusted_states
from titans.models import VARIANTS, StaticDecoder

from .test_models import tiny_model, tokens

# TINY's chunk 4, window 5, segment 6 (MAC's segments end mid-chunk): 13 new tokens end three chunks and two segments
# and wrap the window's ring; prompts of 1 and 3 tokens stop inside the first chunk, 11 passes the window and a segment.
PROMPTS = (1, 3, 11)
NEW = 13


def flat(state) -> list[torch.Tensor]:
    """Every tensor of a state (None for a field that holds none), in field order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if hasattr(state, "__dataclass_fields__"):
        return [t for name in state.__dataclass_fields__ for t in flat(getattr(state, name))]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in flat(item)]
    return [state] if state is None else []


def assert_same_state(static, dynamic, tolerance=1e-10):
    pairs = list(zip(flat(static), flat(dynamic), strict=True))
    assert pairs
    for a, b in pairs:
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype
            assert a.numel() == 0 or (a - b).abs().max() <= tolerance




@pytest.mark.parametrize("variant", VARIANTS)
def test_the_static_step_generates_the_dynamic_tokens_and_state(variant):
    model = tiny_model(variant)
    for length in PROMPTS:
        prompt = tokens(2, length, seed=length)
        dynamic, dynamic_state = model.generate(prompt, NEW, temperature=0, return_state=True)
        static, static_state = model.generate(prompt, NEW, temperature=0, return_state=True, decode="static")
        assert torch.equal(static, dynamic), f"prompt of {length}"
        assert_same_state(static_state, dynamic_state)
    # sampling: the same draws from the same generator; and a caller's state continued
    draws = [model.generate(prompt, 6, top_k=8, generator=torch.Generator().manual_seed(3), decode=decode,
                            state=dynamic_state, return_state=True) for decode in ("dynamic", "static")]
    assert torch.equal(draws[0][0], draws[1][0])
    assert_same_state(draws[1][1], draws[0][1])


@pytest.mark.parametrize("variant, overrides", [
    ("mac", dict(segment_len=8)),  # segments that end with a chunk (the memory's copy has no pending tokens)
    ("mac", dict(n_persistent=0)),
    ("mag", dict(n_persistent=0, window=3)),
    # MAC's switches (issue 47), all four at once: each changes what the step reads, writes or adds
    ("mac", dict(mac_write_input=True, mac_residual_read=True, mac_position_free_persistent=True,
                 mac_separate_norms=True)),
    # the memory's other paths: channel-wise α (the chunk path per token), the surprise gate, chunk-pooled gates
    ("lmm", dict(memory_forgetting_channels=True)),
    ("lmm", dict(surprise_gate=True, gate_pooling="chunk", memory_depth=1)),
])
def test_the_static_step_across_configurations(variant, overrides):
    model = tiny_model(variant, **overrides)
    prompt = tokens(2, 5, seed=1)
    dynamic, dynamic_state = model.generate(prompt, 11, temperature=0, return_state=True)
    static, static_state = model.generate(prompt, 11, temperature=0, return_state=True, decode="static")
    assert torch.equal(static, dynamic)
    assert_same_state(static_state, dynamic_state)


def test_a_decoder_that_takes_no_step_gives_back_the_state_it_was_given():
    for variant in ("mac", "mag", "transformer"):
        model = tiny_model(variant)
        state = model(tokens(1, 7))[1]
        assert_same_state(StaticDecoder(model, state, 0).state(), state, tolerance=0)


def test_the_decoder_refuses_what_it_cannot_serve():
    model = tiny_model("mag")
    state = model(tokens(2, 3))[1]
    decoder = StaticDecoder(model, state, max_steps=2)
    decoder.step(tokens(2, 1))
    with pytest.raises(ValueError, match=r"must keep the shape \(2, 1\)"):
        decoder.step(tokens(1, 1))
    decoder.step(tokens(2, 1))
    with pytest.raises(ValueError, match="all 2 steps it was built for are taken"):
        decoder.step(tokens(2, 1))
    with pytest.raises(ValueError, match=r"tokens must be a \[batch, 1\] long tensor"):
        StaticDecoder(model, state, 2).step(tokens(2, 2))
    with pytest.raises(ValueError, match="after at least one token"):
        StaticDecoder(model, [None, None], 2)
    with pytest.raises(ValueError, match="max_steps must be an integer >= 0"):
        StaticDecoder(model, state, -1)
    with pytest.raises(ValueError, match="CUDA graphs need a model on a CUDA device, this one is on cpu"):
        StaticDecoder(model, state, 2, graphs=True)
    # a static state steps one token at a time, whichever layer is handed more
    static = StaticDecoder(model, state, 2).blocks
    with trusted_states(), pytest.raises(ValueError, match="steps one token at a time, got 3 tokens"):
        model._logits(tokens(2, 3), static)


def test_generate_refuses_a_decode_it_cannot_run():
    model = tiny_model("lmm")
    prompt = tokens(1, 3)
    decodes = r"\('dynamic', 'compiled', 'static', 'graph'\)"
    with pytest.raises(ValueError, match=rf"decode must be one of {decodes}, got 'fast'"):
        model.generate(prompt, 2, decode="fast")
    with pytest.raises(ValueError, match="decode='graph' captures CUDA graphs: it needs a model and prompt on a CUDA"):
        model.generate(prompt, 2, decode="graph")
    assert model.generate(prompt, 0, decode="static").shape == (1, 3)
