"""Layers: every attention fast path against its plain reference (float64), bounded caches, RoPE,
SwiGLU, RMSNorm, persistent tokens, conv streaming."""

import math

import pytest
import torch
import torch.nn.functional as F

import titans.layers.attention as attention_module
from titans.layers import (
    Attention,
    CausalDepthwiseConv,
    PersistentMemory,
    RMSNorm,
    RotaryEmbedding,
    SegmentAttention,
    SwiGLU,
    banded_attention,
    reference_attention,
    reference_segment_attention,
    segment_attention,
    segment_visibility,
    visibility,
)

DT = torch.float64


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


# ------------------------------------------------------------------ sliding window / full causal
def test_visibility_rule_by_enumeration():
    prefix, window = 2, 3
    q_pos, k_pos = torch.arange(2, 9), torch.arange(9)
    mask = visibility(q_pos, k_pos, prefix_len=prefix, window=window)
    for a, i in enumerate(q_pos.tolist()):
        for b, j in enumerate(k_pos.tolist()):
            assert mask[a, b].item() == (j <= i and (j < prefix or i - j < window)), (i, j)
    assert torch.equal(visibility(q_pos, k_pos, prefix, None), k_pos[None] <= q_pos[:, None])


@pytest.mark.parametrize("window, prefix, block", [(8, 0, 16), (50, 3, 64), (1, 2, 7), (300, 0, 64), (5, 4, None)])
def test_banded_equals_reference(window, prefix, block):
    seq = 260
    q = randn(2, 2, seq, 8, seed=window)
    k, v = randn(2, 2, prefix + seq, 8, seed=1), randn(2, 2, prefix + seq, 8, seed=2)
    k_pos = torch.arange(prefix + seq)
    q_pos = torch.arange(prefix, prefix + seq)
    fast = banded_attention(q, q_pos, k, v, k_pos, prefix, window, block=block)
    plain = reference_attention(q, q_pos, k, v, k_pos, prefix, window)
    assert (fast - plain).abs().max() <= 1e-12


def test_banded_with_cached_past_equals_reference():
    """Queries continue a stream: keys are the prefix, `window` cached keys, then the new ones."""
    prefix, window, past, new = 3, 6, 6, 150
    q = randn(1, 2, new, 8, seed=3)
    k, v = randn(1, 2, prefix + past + new, 8, seed=4), randn(1, 2, prefix + past + new, 8, seed=5)
    start = 40  # absolute position of the first new query
    k_pos = torch.cat([torch.arange(prefix), torch.arange(start - past, start + new)])
    q_pos = torch.arange(start, start + new)
    fast = banded_attention(q, q_pos, k, v, k_pos, prefix, window, block=16)
    assert (fast - reference_attention(q, q_pos, k, v, k_pos, prefix, window)).abs().max() <= 1e-12


def test_banded_memory_is_linear_in_length(monkeypatch):
    """No SDPA call sees more than prefix + block + window keys: O(T · window) memory, not O(T²)."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    prefix, window, seq = 2, 8, 1000
    q = randn(1, 1, seq, 4)
    k = v = randn(1, 1, prefix + seq, 4, seed=1)
    banded_attention(q, torch.arange(prefix, prefix + seq), k, v, torch.arange(prefix + seq), prefix, window)
    block = attention_module.MIN_QUERY_BLOCK
    assert len(seen) == math.ceil(seq / block)
    assert max(n_keys for _, n_keys in seen) <= prefix + block + window - 1


@pytest.mark.parametrize("window, prefix", [(None, 0), (None, 2), (4, 0), (4, 3)])
def test_attention_module_equals_reference(window, prefix):
    """The module against the rule written out score by score: RoPE between ordinary tokens, a plain dot product
    with a persistent (prefix) token, the visibility mask, an explicit softmax."""
    torch.manual_seed(0)
    attention = Attention(16, 2, window=window).to(DT)
    x = randn(2, 23, 16)
    y, _ = attention(x, prefix_len=prefix)
    plain = attention_module.reference_window_attention(attention, x, prefix)
    assert (y - plain).abs().max() <= 1e-12
    if prefix:  # the two-part queries and keys score the prefix without RoPE: the same through the plain softmax
        positions = torch.arange(23)
        q, k, v = attention.project(x, positions)
        q_plain, k_plain, _ = attention.project(x, None)
        q2, keys = attention_module.position_free_prefix(q, q_plain, k_plain[:, :, :prefix], k[:, :, prefix:])
        two_part = reference_attention(q2, positions, keys, v, positions, prefix, window, scale=8**-0.5)
        assert (attention.merge(two_part) - plain).abs().max() <= 1e-12


@pytest.mark.parametrize("window", [None, 4])
def test_persistent_prefix_carries_no_position(window):
    """What a query draws from the persistent prefix does not depend on how far into the stream it is: with
    the prefix alone visible besides the query itself (window 1), the output is the same at position 5 and 500.
    (Through RoPE the prefix's phase would grow with the position, a clock that stops at the training length.)"""
    torch.manual_seed(0)
    attention = Attention(16, 2, window=1 if window else None).to(DT)
    prefix, token = randn(1, 3, 16), randn(1, 1, 16, seed=1)
    outputs = []
    for filler in (2, 497):
        _, cache = attention(torch.cat([prefix, randn(1, filler, 16, seed=2)], 1), prefix_len=3)
        outputs.append(attention(token, cache)[0])
    if window:
        assert (outputs[0] - outputs[1]).abs().max() <= 1e-12
    else:  # full attention also reads the filler, so only the prefix's part is position-free
        assert outputs[0].shape == outputs[1].shape


@pytest.mark.parametrize("window, prefix", [(None, 0), (4, 0), (4, 3), (None, 2)])
def test_streaming_with_cache_equals_one_call(window, prefix):
    torch.manual_seed(0)
    attention = Attention(16, 2, window=window).to(DT)
    x = randn(2, 30, 16)
    y, _ = attention(x, prefix_len=prefix)
    pieces, cache = [], None
    for a, b in [(0, prefix + 1), (prefix + 1, prefix + 6), (prefix + 6, 17), (17, 18), (18, 30)]:
        out, cache = attention(x[:, a:b], cache, prefix_len=prefix)
        pieces.append(out)
        if window is not None:  # bounded: the prefix plus at most `window` recent keys
            assert cache.k.shape[2] == min(window, b - prefix) and cache.prefix_k.shape[2] == prefix
    assert (torch.cat(pieces, 1) - y).abs().max() <= 1e-12
    assert cache.pos == 30


def test_bad_attention_arguments():
    with pytest.raises(ValueError, match="window"):
        Attention(16, 2, window=0)
    with pytest.raises(ValueError, match="divisible"):
        Attention(15, 2)
    with pytest.raises(ValueError, match="prefix_len"):
        Attention(16, 2)(randn(1, 3, 16).float(), prefix_len=4)


def test_attention_refuses_a_cache_it_could_not_have_returned():
    torch.manual_seed(0)
    windowed = Attention(16, 2, window=4).to(DT)
    _, cache = windowed(randn(2, 9, 16), prefix_len=2)
    assert windowed(randn(2, 3, 16, seed=1), cache)[0].shape == (2, 3, 16)  # its own cache goes on
    with pytest.raises(ValueError, match=r"state.prefix_k has shape \[2, 2, 2, 8\], expected \[3, 2, \*, 8\]"):
        windowed(randn(3, 3, 16), cache)  # another batch
    with pytest.raises(ValueError, match=r"state.prefix_k has shape .*expected \[2, 4, \*, 4\]"):
        Attention(16, 4, window=4).to(DT)(randn(2, 3, 16), cache)  # other heads
    with pytest.raises(ValueError, match="full attention keeps 7 after 7 tokens"):
        Attention(16, 2).to(DT)(randn(2, 3, 16), cache)  # a window's cache for full attention
    with pytest.raises(ValueError, match="a window of 6 keeps 6 after 7 tokens"):
        Attention(16, 2, window=6).to(DT)(randn(2, 3, 16), cache)
    with pytest.raises(ValueError, match="continues from a state of type KVCache, got SegmentCache"):
        windowed(randn(2, 3, 16), SegmentAttention(16, 2, segment_len=7).to(DT)(randn(2, 3, 16), randn(2, 3, 16))[1])


# ------------------------------------------------------------------------------ MAC segment
def test_segment_visibility_rule():
    mask = segment_visibility(n_persistent=2, offset=1, n_queries=3, n_keys=4)
    # query at segment offset 2 (the second row): both persistent tokens, h_0..h_2, x_0..x_2
    assert mask[1].tolist() == [True, True, True, True, True, False, True, True, True, False]
    assert mask[:, :2].all()


@pytest.mark.parametrize("n_persistent, offset, n", [(0, 0, 7), (3, 0, 7), (2, 4, 3), (2, 6, 1), (0, 0, 1)])
def test_segment_attention_equals_reference(n_persistent, offset, n):
    n_keys = offset + n
    q = randn(2, 2, n, 8, seed=offset)
    k, v = randn(2, 2, n_persistent + 2 * n_keys, 8, seed=1), randn(2, 2, n_persistent + 2 * n_keys, 8, seed=2)
    fast = segment_attention(q, k, v, n_persistent, offset)
    plain = reference_segment_attention(q, k, v, n_persistent, offset)
    assert (fast - plain).abs().max() <= 1e-12


def test_segment_attention_streams_within_a_segment_and_resets():
    torch.manual_seed(0)
    layer = SegmentAttention(16, 2, segment_len=7).to(DT)
    x, h, p = randn(2, 7, 16, seed=1), randn(2, 7, 16, seed=2), randn(3, 16, seed=3)
    y, cache = layer(x, h, p)
    assert cache.length == 0  # a complete segment leaves nothing behind
    pieces, cache = [], None
    for a, b in [(0, 2), (2, 3), (3, 7)]:
        out, cache = layer(x[:, a:b], h[:, a:b], p, cache)
        pieces.append(out)
        assert cache.length == b % 7
    assert (torch.cat(pieces, 1) - y).abs().max() <= 1e-12
    with pytest.raises(ValueError, match="crosses the segment end"):
        layer(x[:, :5], h[:, :5], p, layer(x[:, :3], h[:, :3], p)[1])
    with pytest.raises(ValueError, match=r"state.k_h has shape \[2, 2, 3, 8\], expected \[1, 2, \*, 8\]"):
        layer(x[:1, :2], h[:1, :2], p, layer(x[:, :3], h[:, :3], p)[1])  # a cache of another batch


def test_segment_attention_is_causal_in_h_and_x():
    torch.manual_seed(0)
    layer = SegmentAttention(16, 2, segment_len=6).to(DT)
    x, h = randn(1, 6, 16, seed=1), randn(1, 6, 16, seed=2)
    y, _ = layer(x, h)
    for j in range(6):
        for which in ("x", "h"):
            x2, h2 = x.clone(), h.clone()
            (x2 if which == "x" else h2)[:, j] += 1.0
            y2, _ = layer(x2, h2)
            assert torch.equal(y2[:, :j], y[:, :j]), (which, j)
            assert (y2[:, j] - y[:, j]).abs().max() > 1e-6, (which, j)


# ------------------------------------------------------------------------- small blocks
def test_rope_is_relative_and_norm_preserving():
    rope = RotaryEmbedding(8)
    q, k = randn(1, 1, 1, 8, seed=1), randn(1, 1, 1, 8, seed=2)

    def score(i, j):
        return (rope(q, torch.tensor([i])) * rope(k, torch.tensor([j]))).sum().item()

    assert score(10, 7) == pytest.approx(score(103, 100), abs=1e-12)
    assert score(10, 7) != pytest.approx(score(10, 8), abs=1e-6)
    assert rope(q, torch.tensor([0])).equal(q)
    assert rope(q, torch.tensor([37])).norm().item() == pytest.approx(q.norm().item(), abs=1e-12)
    with pytest.raises(ValueError, match="head_dim"):
        RotaryEmbedding(7)


def test_swiglu_and_rmsnorm_match_their_formulas():
    torch.manual_seed(0)
    mlp = SwiGLU(6, 10).to(DT)
    x = randn(2, 3, 6)
    w_gate, w_up = mlp.gate_up.weight[:10], mlp.gate_up.weight[10:]
    expected = (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ mlp.down.weight.T
    assert (mlp(x) - expected).abs().max() <= 1e-12
    norm = RMSNorm(6, eps=1e-6).to(DT)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 7.0))
    expected = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * torch.arange(1.0, 7.0, dtype=DT)
    assert (norm(x) - expected).abs().max() <= 1e-12
    with pytest.raises(ValueError, match="hidden"):
        SwiGLU(6, 0)


def test_persistent_tokens_are_prepended_and_input_independent():
    memory = PersistentMemory(3, 4).to(DT)
    a, b = memory.prepend(randn(2, 5, 4, seed=1)), memory.prepend(randn(2, 5, 4, seed=2))
    assert a.shape == (2, 8, 4) and len(memory) == 3
    assert torch.equal(a[:, :3], b[:, :3]) and torch.equal(a[1, :3], memory.tokens)
    with pytest.raises(ValueError, match="num_tokens"):
        PersistentMemory(-1, 4)


@pytest.mark.parametrize("kernel,with_bias", [(4, True), (4, False), (1, True), (3, True)])
def test_conv_equals_conv1d_values_and_gradients(kernel, with_bias):
    # The shifted multiply-adds against torch's depthwise conv1d on the zero-padded input (the plain reference).
    from titans.layers import causal_depthwise_conv

    x = randn(2, 9, 5).requires_grad_()
    weight = randn(5, kernel, seed=1).requires_grad_()
    bias = randn(5, seed=2).requires_grad_() if with_bias else None
    y, _ = causal_depthwise_conv(x, weight, bias, None)
    padded = F.pad(x.transpose(1, 2), (kernel - 1, 0))
    ref = F.conv1d(padded, weight.unsqueeze(1), bias, groups=5).transpose(1, 2)
    assert (y - ref).abs().max() <= 1e-14
    g = randn(*y.shape, seed=3)
    params = [t for t in (x, weight, bias) if t is not None]
    grads = torch.autograd.grad(y, params, g)
    ref_grads = torch.autograd.grad(ref, params, g)
    assert all((a - b).abs().max() <= 1e-13 for a, b in zip(grads, ref_grads))


def test_conv_gradients_through_the_cache_and_second_order():
    # The hand-written backward (`_ShiftedMultiplyAdd`) also feeds the carried cache and supports double backward.
    from titans.layers import causal_depthwise_conv

    x, weight, bias, cache = (randn(*shape, seed=i).requires_grad_() for i, shape in
                              enumerate([(2, 7, 3), (3, 4), (3,), (2, 3, 3)]))
    conv = lambda *args: causal_depthwise_conv(*args)[0]  # noqa: E731
    assert torch.autograd.gradcheck(conv, (x, weight, bias, cache))
    assert torch.autograd.gradgradcheck(conv, (x, weight, bias, cache))


def test_conv_streaming_and_causality():
    torch.manual_seed(0)
    conv = CausalDepthwiseConv(6, kernel=4).to(DT)
    x = randn(2, 11, 6)
    y, _ = conv(x)
    y1, cache = conv(x[:, :5])
    y2, _ = conv(x[:, 5:], cache)
    assert (torch.cat([y1, y2], 1) - y).abs().max() <= 1e-14
    x2 = x.clone()
    x2[:, 7] += 1
    assert torch.equal(conv(x2)[0][:, :7], y[:, :7])
