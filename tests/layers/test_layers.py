"""Layers: banded sliding-window attention against the one-mask reference, caches, RoPE, conv."""

import pytest
import torch

from titans.layers import (Attention, CausalDepthwiseConv, RotaryEmbedding, banded_attention, reference_attention,
                           visibility)

DT = torch.float64


@pytest.mark.parametrize("window, prefix, block", [(8, 0, 16), (50, 3, 64), (1, 2, 7), (300, 0, 64)])
def test_banded_equals_reference(window, prefix, block):
    g = torch.Generator().manual_seed(window)
    seq = 500
    q = torch.randn(2, 2, seq, 8, generator=g, dtype=DT)
    k = torch.randn(2, 2, prefix + seq, 8, generator=g, dtype=DT)
    v = torch.randn(2, 2, prefix + seq, 8, generator=g, dtype=DT)
    k_pos = torch.cat([torch.arange(prefix), torch.arange(prefix, prefix + seq)])
    q_pos = torch.arange(prefix, prefix + seq)
    fast = banded_attention(q, q_pos, k, v, k_pos, prefix, window, block=block)
    plain = reference_attention(q, q_pos, k, v, k_pos, prefix, window)
    assert (fast - plain).abs().max() <= 1e-12


def test_visibility_rule():
    mask = visibility(torch.arange(2, 7), torch.arange(7), prefix_len=2, window=2)
    # query at position 6 sees the prefix (0, 1) and keys 5, 6 only
    assert mask[-1].tolist() == [True, True, False, False, False, True, True]
    assert not mask[0, 3:].any()  # nothing from the future


@pytest.mark.parametrize("window, prefix", [(None, 0), (4, 0), (4, 3), (None, 2)])
def test_streaming_with_cache_equals_one_call(window, prefix):
    torch.manual_seed(0)
    attention = Attention(16, 2, window=window).to(DT)
    x = torch.randn(2, 30, 16, dtype=DT)
    y, cache = attention(x, prefix_len=prefix)
    pieces, c = [], None
    for a, b in [(0, prefix + 1), (prefix + 1, prefix + 6), (prefix + 6, 30)]:
        out, c = attention(x[:, a:b], c, prefix_len=prefix)
        pieces.append(out)
    assert (torch.cat(pieces, 1) - y).abs().max() <= 1e-12
    if window is not None:
        assert c.k.shape[2] <= window and c.prefix_k.shape[2] == prefix


def test_bad_attention_arguments():
    with pytest.raises(ValueError, match="window"):
        Attention(16, 2, window=0)
    with pytest.raises(ValueError, match="divisible"):
        Attention(15, 2)


def test_rope_is_relative():
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 1, 1, 8, dtype=DT), torch.randn(1, 1, 1, 8, dtype=DT)
    score = lambda i, j: (rope(q, torch.tensor([i])) * rope(k, torch.tensor([j]))).sum()  # noqa: E731
    assert score(10, 7).item() == pytest.approx(score(103, 100).item(), abs=1e-12)
    assert rope(q, torch.tensor([0])).equal(q)


def test_conv_streaming_and_causality():
    torch.manual_seed(0)
    conv = CausalDepthwiseConv(6, kernel=4).to(DT)
    x = torch.randn(2, 11, 6, dtype=DT)
    y, _ = conv(x)
    y1, cache = conv(x[:, :5])
    y2, _ = conv(x[:, 5:], cache)
    assert (torch.cat([y1, y2], 1) - y).abs().max() <= 1e-14
    x2 = x.clone()
    x2[:, 7] += 1
    assert torch.equal(conv(x2)[0][:, :7], y[:, :7])
