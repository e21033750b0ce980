"""Attention as short-term memory, through `F.scaled_dot_product_attention`, with bounded KV caches.

One rule covers the full-causal and sliding-window shapes: key j is visible to query i when
j ≤ i and (j is a persistent-prefix token, or i − j < window). Positions are absolute, so a stream
fed in pieces with its `KVCache` gives the same outputs as one call. The sliding-window path runs
in query blocks, each against its own key band, so memory is O(T · window), not O(T²);
`reference_attention` is the plain one-mask version it is tested against.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .rope import RotaryEmbedding


@dataclasses.dataclass
class KVCache:
    """Keys/values (after RoPE) a stream still needs: the prefix, and at most `window` recent ones."""

    prefix_k: Tensor  # [batch, heads, P, head_dim], always visible
    prefix_v: Tensor
    k: Tensor  # [batch, heads, L, head_dim], positions pos − L .. pos − 1
    v: Tensor
    pos: int = 0  # absolute position of the next token (the prefix occupies 0 .. P − 1)


def visibility(q_pos: Tensor, k_pos: Tensor, prefix_len: int, window: Optional[int]) -> Tensor:
    """Boolean [q, k]: causal, and within the window unless the key is a prefix token."""
    causal = k_pos[None, :] <= q_pos[:, None]
    if window is None:
        return causal
    near = (q_pos[:, None] - k_pos[None, :]) < window
    return causal & (near | (k_pos[None, :] < prefix_len))


def masked_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def reference_attention(q, q_pos, k, v, k_pos, prefix_len, window):
    """Plain version: one mask over every key."""
    return masked_attention(q, k, v, visibility(q_pos, k_pos, prefix_len, window))


def banded_attention(q, q_pos, k, v, k_pos, prefix_len, window, block: int = 256):
    """Same result as `reference_attention`; query blocks only see their key band plus the prefix.

    Keys must be sorted by position with the prefix (positions < prefix_len) first.
    """
    if window is None or k.shape[2] <= block + window:
        return reference_attention(q, q_pos, k, v, k_pos, prefix_len, window)
    n_prefix = int((k_pos < prefix_len).sum())
    outputs = []
    for start in range(0, q.shape[2], block):
        qp = q_pos[start : start + block]
        lo = int(torch.searchsorted(k_pos[n_prefix:], qp[0] - window + 1)) + n_prefix
        hi = int(torch.searchsorted(k_pos[n_prefix:], qp[-1], right=True)) + n_prefix
        idx = torch.cat([torch.arange(n_prefix, device=k.device), torch.arange(lo, hi, device=k.device)])
        outputs.append(reference_attention(q[:, :, start : start + block], qp, k[:, :, idx], v[:, :, idx],
                                           k_pos[idx], prefix_len, window))
    return torch.cat(outputs, dim=2)


class Attention(nn.Module):
    """Multi-head causal attention with RoPE; `window=None` is full attention (Transformer++).

    `forward(x, cache, prefix_len)`: on the first call of a stream (cache None) the first
    `prefix_len` tokens of x are persistent-memory tokens, visible to every later query.
    """

    def __init__(self, dim: int, heads: int, window: Optional[int] = None, rope_base: float = 10_000.0,
                 dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.heads, self.head_dim, self.window = heads, dim // heads, window
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.rope = RotaryEmbedding(self.head_dim, rope_base)
        self.dropout = nn.Dropout(dropout)

    def project(self, x: Tensor, positions: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v `[batch, heads, seq, head_dim]`; RoPE at `positions` (None: no rotation)."""
        q, k, v = (t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if positions is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)
        return q, k, v

    def merge(self, y: Tensor) -> Tensor:
        return self.dropout(self.out(y.transpose(1, 2).flatten(2)))

    def forward(self, x: Tensor, cache: Optional[KVCache] = None, prefix_len: int = 0) -> tuple[Tensor, KVCache]:
        batch, seq, _ = x.shape
        pos = cache.pos if cache is not None else 0
        positions = torch.arange(pos, pos + seq, device=x.device)
        q, k, v = self.project(x, positions)
        if cache is None:
            empty = k[:, :, :0]
            cache = KVCache(k[:, :, :prefix_len], v[:, :, :prefix_len], empty, empty, 0)
            k, v, positions_kv = k[:, :, prefix_len:], v[:, :, prefix_len:], positions[prefix_len:]
        else:
            positions_kv = positions
        n_prefix, n_past = cache.prefix_k.shape[2], cache.k.shape[2]
        keys = torch.cat([cache.prefix_k, cache.k, k], dim=2)
        values = torch.cat([cache.prefix_v, cache.v, v], dim=2)
        k_pos = torch.cat([
            torch.arange(n_prefix, device=x.device),
            torch.arange(pos - n_past, pos, device=x.device),
            positions_kv,
        ])
        if self.window is None and n_past == 0 and n_prefix == 0:
            y = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        else:
            y = banded_attention(q, positions, keys, values, k_pos, n_prefix, self.window)
        recent_k, recent_v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        if self.window is not None:  # the cache never holds more than the window
            recent_k, recent_v = recent_k[:, :, -self.window :], recent_v[:, :, -self.window :]
        return self.merge(y), KVCache(cache.prefix_k, cache.prefix_v, recent_k, recent_v, pos + seq)
