"""Attention as short-term memory, through `F.scaled_dot_product_attention`, with bounded caches.

Three shapes:
1. full causal (Transformer++) and
2. sliding window with an always-visible persistent prefix (SWA, MAG, MAL): one rule covers both —
   key j is visible to query i when j ≤ i and (j is a prefix token, or i − j < window). Positions are
   absolute, so a stream fed in pieces with its `KVCache` gives the same outputs as one call. Long
   sequences run in query blocks of max(window, 64) queries, each against its own key band plus the
   prefix, so memory is O(T · window), not O(T²). Persistent tokens carry no position: query i scores
   prefix key p as q_i · k_p, not through RoPE, whose phase between them would grow with i and hand the
   model a clock that only runs as far as the training length (`position_free_prefix`).
3. MAC segment attention: queries are the segment's tokens x_i; keys are [persistent p (all visible) ‖
   retrieved memory tokens h (h_j visible iff j ≤ i, since h_j is read with x_j's query) ‖ x (causal)].
   The `SegmentCache` holds the current segment's h and x keys/values (≤ segment length each).

Each fast path has a plain reference beside it (explicit softmax, no fused kernel) that the tests
compare it with in float64.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .rope import RotaryEmbedding
from .state import DecodeClock, check_state_shapes, check_state_type, states_trusted

# Query blocks are at least this long: much shorter blocks pay more in per-call overhead than they
# save in masked-out scores.
MIN_QUERY_BLOCK = 64


@dataclasses.dataclass
class KVCache:
    """Keys/values a stream still needs: the prefix (no RoPE), and at most `window` recent ones (after RoPE)."""

    prefix_k: Tensor  # [batch, heads, P, head_dim], always visible, without RoPE (persistent tokens have no position)
    prefix_v: Tensor
    k: Tensor  # [batch, heads, L, head_dim], positions pos − L .. pos − 1
    v: Tensor
    pos: int = 0  # absolute position of the next token (the prefix occupies 0 .. P − 1)


@dataclasses.dataclass
class SegmentCache:
    """Keys/values of the current MAC segment so far: retrieved memory tokens h and inputs x."""

    k_h: Tensor  # [batch, heads, n, head_dim], n < segment length; n = 0 at a segment boundary
    v_h: Tensor
    k_x: Tensor
    v_x: Tensor

    @property
    def length(self) -> int:
        return self.k_x.shape[2]


# Static decoding (`titans.models.StaticDecoder`): the same caches in buffers whose shapes never change, written in
# place at slots computed on the device from the clock, so that a one-token step can be captured in a CUDA graph.
@dataclasses.dataclass
class StaticKVCache:
    """A `KVCache` of fixed shape: the recent keys/values in a ring of `capacity` slots (the window, or for full
    attention every position the decode will reach), band position j (the j-th token after the prefix) in slot
    j mod capacity. Slot order is not position order: attention is a sum over keys, and each key carries its
    position in its RoPE rotation."""

    prefix_k: Tensor  # as in KVCache
    prefix_v: Tensor
    k: Tensor  # [batch, heads, capacity, head_dim]
    v: Tensor
    clock: DecodeClock
    start_pos: int  # KVCache.pos when the decode began

    def dynamic(self) -> KVCache:
        """The `KVCache` the dynamic step would hold now (its keys in position order)."""
        pos, capacity = self.start_pos + self.clock.steps, self.k.shape[2]
        band = pos - self.prefix_k.shape[2]
        slots = torch.arange(band - min(band, capacity), band, device=self.k.device) % capacity
        return KVCache(self.prefix_k, self.prefix_v, self.k[:, :, slots], self.v[:, :, slots], pos)


@dataclasses.dataclass
class StaticSegmentCache:
    """A `SegmentCache` of fixed shape: `segment_len` slots each for h and x, slot j holding segment offset j (valid
    up to the current token's offset; what a finished segment left beyond it is masked, never cleared)."""

    k_h: Tensor  # [batch, heads, segment_len, head_dim]
    v_h: Tensor
    k_x: Tensor
    v_x: Tensor
    clock: DecodeClock
    start_offset: int  # SegmentCache.length when the decode began

    def offset_after(self, steps: int) -> int:
        """The segment offset of the next token after `steps` steps (host)."""
        return (self.start_offset + steps) % self.k_x.shape[2]

    @property
    def length(self) -> int:
        return self.offset_after(self.clock.steps)

    def phase(self) -> bool:
        """What of the position a step's Python reads: whether this step ends the segment (MAC's memory switch)."""
        return self.length == self.k_x.shape[2] - 1

    def dynamic(self) -> SegmentCache:
        n = self.length
        return SegmentCache(*(t[:, :, :n].clone() for t in (self.k_h, self.v_h, self.k_x, self.v_x)))


def one_token(owner: str, x: Tensor) -> None:
    if x.shape[1] != 1:
        raise ValueError(f"{owner}: a static decode state steps one token at a time, got {x.shape[1]} tokens")


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: Optional[float] = None) -> Tensor:
    """softmax(q kᵀ · scale, masked to `visible`) v written out (scale 1/√d by default): the plain form the fused
    paths are tested against."""
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


# ----------------------------------------------------------------------- full / sliding window
def visibility(q_pos: Tensor, k_pos: Tensor, prefix_len: int, window: Optional[int]) -> Tensor:
    """Boolean [q, k]: causal, and within the window unless the key is a prefix token."""
    causal = k_pos[None, :] <= q_pos[:, None]
    if window is None:
        return causal
    near = (q_pos[:, None] - k_pos[None, :]) < window
    return causal & (near | (k_pos[None, :] < prefix_len))


def reference_attention(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor, prefix_len: int,
                        window: Optional[int], scale: Optional[float] = None) -> Tensor:
    """Plain version: one mask over every key, explicit softmax."""
    return explicit_attention(q, k, v, visibility(q_pos, k_pos, prefix_len, window), scale)


def reference_window_attention(attention: Attention, x: Tensor, prefix_len: int) -> Tensor:
    """`Attention`'s rule on one whole stream x (its first `prefix_len` tokens persistent), score by score: RoPE's
    (R_i q_i) · (R_j k_j) between ordinary tokens, the plain q_i · k_p with a persistent token, the visibility
    mask, an explicit softmax. The plain form `Attention.forward` is tested against."""
    positions = torch.arange(x.shape[1], device=x.device)
    q_plain, k_plain, v = attention.project(x, None)
    q, k = attention.rope(q_plain, positions), attention.rope(k_plain, positions)
    scores = q @ k.transpose(-1, -2)
    scores[..., :prefix_len] = q_plain @ k_plain[:, :, :prefix_len].transpose(-1, -2)
    visible = visibility(positions, positions, prefix_len, attention.window)
    y = (scores / math.sqrt(attention.head_dim)).masked_fill(~visible, float("-inf")).softmax(-1) @ v
    return attention.merge(y)


def position_free_prefix(q: Tensor, q_plain: Tensor, prefix_k: Tensor, band_k: Tensor) -> tuple[Tensor, Tensor]:
    """Queries and keys (twice the head width) whose dot products are q_i · k_p for the persistent prefix and
    RoPE's (R_i q_i) · (R_j k_j) for every other key: [R_i q_i ‖ q_i] against [0 ‖ k_p] and [R_j k_j ‖ 0], so one
    attention call scores both (at the head width's scale, 1/√d, passed explicitly).

    q `[b, h, n, d]` after RoPE and `q_plain` the same queries before it; `prefix_k` `[b, h, P, d]` without RoPE;
    `band_k` `[b, h, L, d]` after it. Returns (q `[b, h, n, 2d]`, keys `[b, h, P + L, 2d]`, the prefix first)."""
    keys = torch.cat([torch.cat([torch.zeros_like(prefix_k), prefix_k], dim=-1),
                      torch.cat([band_k, torch.zeros_like(band_k)], dim=-1)], dim=2)
    return torch.cat([q, q_plain], dim=-1), keys


def banded_attention(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor, prefix_len: int,
                     window: Optional[int], block: Optional[int] = None, scale: Optional[float] = None) -> Tensor:
    """Same result as `reference_attention`, through SDPA; with a window, query blocks of `block`
    (default max(window, MIN_QUERY_BLOCK)) only see their key band plus the prefix: O(T · window) memory.

    q `[batch, heads, n, d]` at positions `q_pos` (increasing); keys sorted by position, the prefix
    (positions < prefix_len) first.
    """
    block = block or max(window or 0, MIN_QUERY_BLOCK)
    if window is None or k.shape[2] <= block + window:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visibility(q_pos, k_pos, prefix_len, window),
                                              scale=scale)
    n_prefix = int((k_pos < prefix_len).sum())
    band_pos = k_pos[n_prefix:]
    outputs = []
    for start in range(0, q.shape[2], block):
        qp = q_pos[start : start + block]
        lo = int(torch.searchsorted(band_pos, qp[0] - window + 1)) + n_prefix
        hi = int(torch.searchsorted(band_pos, qp[-1], right=True)) + n_prefix
        idx = torch.cat([torch.arange(n_prefix, device=k.device), torch.arange(lo, hi, device=k.device)])
        mask = visibility(qp, k_pos[idx], prefix_len, window)
        outputs.append(F.scaled_dot_product_attention(q[:, :, start : start + block], k[:, :, idx], v[:, :, idx],
                                                      attn_mask=mask, scale=scale))
    return torch.cat(outputs, dim=2)


# ----------------------------------------------------------------------------- MAC segment
def segment_visibility(n_persistent: int, offset: int, n_queries: int, n_keys: int,
                       device: Optional[torch.device] = None) -> Tensor:
    """Boolean [n_queries, n_persistent + 2 · n_keys] over [p ‖ h ‖ x] for queries at segment offsets
    offset .. offset + n_queries − 1: every p, and h_j, x_j for j ≤ the query's offset. Made where it is used: a
    copy from host memory to a GPU is a host sync."""
    q_off = torch.arange(offset, offset + n_queries, device=device)
    causal = torch.arange(n_keys, device=device)[None, :] <= q_off[:, None]
    return torch.cat([causal.new_ones(n_queries, n_persistent), causal, causal], dim=1)


def segment_attention(q: Tensor, k: Tensor, v: Tensor, n_persistent: int, offset: int,
                      scale: Optional[float] = None) -> Tensor:
    """Fast path: one SDPA call over keys [p ‖ h ‖ x] (h and x each `(k.shape[2] − n_persistent) / 2` long).
    `scale`: SDPA's (None: 1/√ of q's width; the position-free prefix doubles that width and passes the head's)."""
    n_keys = (k.shape[2] - n_persistent) // 2
    if q.shape[2] == 1 and n_keys == offset + 1:  # one query, the segment's last token so far: it sees every key
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = segment_visibility(n_persistent, offset, q.shape[2], n_keys, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def reference_segment_attention(q: Tensor, k: Tensor, v: Tensor, n_persistent: int, offset: int) -> Tensor:
    """Plain version, query by query: softmax over p, h_0..h_i and x_0..x_i, gathered explicitly."""
    n_keys = (k.shape[2] - n_persistent) // 2
    outputs = []
    for i in range(q.shape[2]):
        seen = offset + i + 1
        idx = [*range(n_persistent), *range(n_persistent, n_persistent + seen),
               *range(n_persistent + n_keys, n_persistent + n_keys + seen)]
        scores = (q[:, :, i : i + 1] @ k[:, :, idx].transpose(-1, -2)) / math.sqrt(q.shape[-1])
        outputs.append(scores.softmax(-1) @ v[:, :, idx])
    return torch.cat(outputs, dim=2)


# --------------------------------------------------------------------------------- modules
class HeadProjections(nn.Module):
    """The learned part every attention shape shares: q, k, v projections with RoPE, output projection."""

    def __init__(self, dim: int, heads: int, rope_base: float = 10_000.0, dropout: float = 0.0):
        super().__init__()
        if heads < 1 or dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.rope = RotaryEmbedding(self.head_dim, rope_base)
        self.dropout = nn.Dropout(dropout)

    def project(self, x: Tensor, positions: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v `[batch, heads, seq, head_dim]`; RoPE at `positions` (None: no rotation)."""
        q, k, v = self._heads(self.qkv(x), 3)
        if positions is not None:
            cos, sin = self.rope.angles(positions, q.dtype)  # one pair of tables for q and k
            q, k = self.rope.rotate(q, cos, sin), self.rope.rotate(k, cos, sin)
        return q, k, v

    def project_keys(self, x: Tensor, positions: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """k, v alone (what `project` returns but q), for tokens that are only attended to."""
        dim = self.heads * self.head_dim
        k, v = self._heads(F.linear(x, self.qkv.weight[dim:]), 2)
        return (k if positions is None else self.rope(k, positions)), v

    def _heads(self, projected: Tensor, parts: int) -> tuple[Tensor, ...]:
        """`parts` tensors `[batch, heads, seq, head_dim]` from `[batch, seq, parts · dim]`."""
        return tuple(t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2) for t in projected.chunk(parts, -1))

    def merge(self, y: Tensor) -> Tensor:
        return self.dropout(self.out(y.transpose(1, 2).flatten(2)))

    def check_cache(self, cache: object, cls: type, batch: int) -> None:
        """`cache` must be a `cls` whose keys and values are `[batch, heads, *, head_dim]`, as this layer returns."""
        owner = type(self).__name__
        check_state_type(owner, cache, cls)
        fields = (f.name for f in dataclasses.fields(cache))  # of the instance: dynamo cannot read a class's
        check_state_shapes(owner, {name: (getattr(cache, name), (batch, self.heads, None, self.head_dim))
                                   for name in fields if isinstance(getattr(cache, name), Tensor)})


class Attention(HeadProjections):
    """Multi-head causal attention with RoPE; `window=None` is full attention (Transformer++).

    `forward(x, cache, prefix_len)`: on the first call of a stream (cache None) the first
    `prefix_len` tokens of x are persistent-memory tokens, visible to every later query. With a
    window the cache never holds more than the prefix plus `window` keys; full attention keeps all.
    """

    def __init__(self, dim: int, heads: int, window: Optional[int] = None, rope_base: float = 10_000.0,
                 dropout: float = 0.0):
        super().__init__(dim, heads, rope_base, dropout)
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window

    def forward(self, x: Tensor, cache: Optional[KVCache] = None, prefix_len: int = 0) -> tuple[Tensor, KVCache]:
        if isinstance(cache, StaticKVCache):
            return self._static_step(x, cache), cache
        if cache is None and not 0 <= prefix_len <= x.shape[1]:  # the prefix only exists at the stream start
            raise ValueError(f"prefix_len must be in [0, {x.shape[1]}], got {prefix_len}")
        if cache is not None:
            self._check_kv_cache(cache, x.shape[0])
        pos = cache.pos if cache is not None else 0
        positions = torch.arange(pos, pos + x.shape[1], device=x.device)
        q_plain, k_plain, v = self.project(x, None)  # the prefix is scored without RoPE, so rotate here
        cos, sin = self.rope.angles(positions, q_plain.dtype)  # one pair of tables for q and k, as in project()
        q, k = self.rope.rotate(q_plain, cos, sin), self.rope.rotate(k_plain, cos, sin)
        if cache is None:  # the prefix's keys are kept without RoPE: persistent tokens have no position
            empty = k[:, :, :0]
            cache = KVCache(k_plain[:, :, :prefix_len], v[:, :, :prefix_len], empty, empty, 0)
            k, v, positions_kv = k[:, :, prefix_len:], v[:, :, prefix_len:], positions[prefix_len:]
        else:
            positions_kv = positions
        n_prefix, n_past = cache.prefix_k.shape[2], cache.k.shape[2]
        band_k = torch.cat([cache.k, k], dim=2)
        values = torch.cat([cache.prefix_v, cache.v, v], dim=2)
        if self.window is None and n_past == 0 and n_prefix == 0:  # plain causal: the fused causal kernel
            y = F.scaled_dot_product_attention(q, band_k, values, is_causal=True)
        else:
            k_pos = torch.cat([
                torch.arange(n_prefix, device=x.device),
                torch.arange(pos - n_past, pos, device=x.device),
                positions_kv,
            ])
            keys = band_k
            if n_prefix:  # the persistent keys first, scored without RoPE
                q, keys = position_free_prefix(q, q_plain, cache.prefix_k, band_k)
            y = banded_attention(q, positions, keys, values, k_pos, n_prefix, self.window, scale=self.head_dim**-0.5)
        recent_k, recent_v = band_k, torch.cat([cache.v, v], dim=2)
        if self.window is not None:  # the cache never holds more than the window
            recent_k, recent_v = recent_k[:, :, -self.window :], recent_v[:, :, -self.window :]
        return self.merge(y), KVCache(cache.prefix_k, cache.prefix_v, recent_k, recent_v, pos + x.shape[1])

    def static_cache(self, cache: KVCache, clock: DecodeClock, steps: int) -> StaticKVCache:
        """`cache` in a ring that holds what `steps` more tokens need: the window, or (full attention) every key."""
        n_prefix = cache.prefix_k.shape[2]
        band, kept = cache.pos - n_prefix, cache.k.shape[2]
        capacity = self.window if self.window is not None else band + steps
        k, v = (t.new_zeros(*t.shape[:2], capacity, t.shape[3]) for t in (cache.k, cache.v))
        slots = torch.arange(band - kept, band, device=k.device) % capacity
        k[:, :, slots], v[:, :, slots] = cache.k, cache.v
        return StaticKVCache(cache.prefix_k, cache.prefix_v, k, v, clock, cache.pos)

    def _static_step(self, x: Tensor, cache: StaticKVCache) -> Tensor:
        """`forward` for one token over a `StaticKVCache`, with no host value that changes from token to token: the
        position, the slot and the mask of valid slots come from the clock's device count."""
        one_token("Attention", x)
        position = cache.start_pos + cache.clock.device_steps  # [1]
        n_prefix, capacity = cache.prefix_k.shape[2], cache.k.shape[2]
        q_plain, k_plain, v = self.project(x, None)
        cos, sin = self.rope.angles(position, q_plain.dtype)
        q, k = self.rope.rotate(q_plain, cos, sin), self.rope.rotate(k_plain, cos, sin)
        band = position - n_prefix
        # writing band position j over j − capacity drops a key no later query sees (j − (j − capacity) ≥ window)
        cache.k.index_copy_(2, band % capacity, k)
        cache.v.index_copy_(2, band % capacity, v)
        visible = torch.arange(capacity, device=x.device) <= band  # before the ring wraps, slots 0..band; then all
        keys, values = cache.k, cache.v
        if n_prefix:
            q, keys = position_free_prefix(q, q_plain, cache.prefix_k, keys)
            values = torch.cat([cache.prefix_v, values], dim=2)
            visible = torch.cat([visible.new_ones(n_prefix), visible])
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[None], scale=self.head_dim**-0.5)
        return self.merge(y)

    def _check_kv_cache(self, cache: KVCache, batch: int) -> None:
        if states_trusted():
            return
        self.check_cache(cache, KVCache, batch)
        # Full attention keeps every past key, a window the last `window`: a cache of the other kind (or of
        # another window) has the wrong number of keys for its position.
        past = cache.pos - cache.prefix_k.shape[2]
        kept = past if self.window is None else min(past, self.window)
        if cache.k.shape[2] != kept:
            window = "full attention" if self.window is None else f"a window of {self.window}"
            raise ValueError(f"Attention: state.k holds {cache.k.shape[2]} keys, but {window} keeps {kept} after "
                             f"{past} tokens (a cache from attention with another window?)")


class SegmentAttention(HeadProjections):
    """MAC's attention over [persistent p ‖ retrieved memory h ‖ segment x] (paper eq. 22).

    `forward(x, h, persistent, cache)`: x and h `[batch, n, dim]` are the next n tokens of the current
    segment and their retrieved memory tokens; they must not cross the segment's end. RoPE puts x_j and
    h_j at position j of the segment; persistent keys carry no rotation. By default query i scores them with its
    rotated query, (R_i q_i) · k_p, a score that turns with i; `position_free_persistent` scores them as the window
    attention scores its prefix, q_i · k_p (`position_free_prefix`). The returned cache is empty when the segment
    is complete.
    """

    def __init__(self, dim: int, heads: int, segment_len: int, rope_base: float = 10_000.0, dropout: float = 0.0,
                 position_free_persistent: bool = False):
        super().__init__(dim, heads, rope_base, dropout)
        if segment_len < 1:
            raise ValueError(f"segment_len must be >= 1, got {segment_len}")
        self.segment_len = segment_len
        self.position_free_persistent = position_free_persistent

    def forward(self, x: Tensor, h: Tensor, persistent: Optional[Tensor] = None,
                cache: Optional[SegmentCache] = None) -> tuple[Tensor, SegmentCache]:
        if isinstance(cache, StaticSegmentCache):
            return self._static_step(x, h, persistent, cache), cache
        if h.shape != x.shape:
            raise ValueError(f"h must have the shape of x {tuple(x.shape)}, got {tuple(h.shape)}")
        if cache is not None:
            self.check_cache(cache, SegmentCache, x.shape[0])
        offset = cache.length if cache is not None else 0
        n = x.shape[1]
        if offset + n > self.segment_len:
            raise ValueError(f"x ({n} tokens at segment offset {offset}) crosses the segment end ({self.segment_len})")
        positions = torch.arange(offset, offset + n, device=x.device)
        position_free = self.position_free_persistent and persistent is not None and persistent.shape[0] > 0
        if position_free:  # the unrotated queries score the persistent keys, so rotate here (as `project` does)
            q_plain, k_x, v_x = self.project(x, None)
            cos, sin = self.rope.angles(positions, q_plain.dtype)
            q, k_x = self.rope.rotate(q_plain, cos, sin), self.rope.rotate(k_x, cos, sin)
        else:
            q, k_x, v_x = self.project(x, positions)
        k_h, v_h = self.project_keys(h, positions)
        if cache is not None:
            k_h, v_h = torch.cat([cache.k_h, k_h], 2), torch.cat([cache.v_h, v_h], 2)
            k_x, v_x = torch.cat([cache.k_x, k_x], 2), torch.cat([cache.v_x, v_x], 2)
        keys, values = self._with_persistent([k_h, k_x], [v_h, v_x], persistent, x)
        n_persistent = persistent.shape[0] if persistent is not None else 0
        y = self._attend(q, q_plain if position_free else None, keys, values, n_persistent, offset)
        if offset + n == self.segment_len:  # segment complete: the next one starts from nothing
            k_h = v_h = k_x = v_x = k_x[:, :, :0]
        return self.merge(y), SegmentCache(k_h, v_h, k_x, v_x)

    def _attend(self, q: Tensor, q_plain: Optional[Tensor], keys: Tensor, values: Tensor, n_persistent: int,
                offset: int) -> Tensor:
        """`segment_attention` over [p ‖ h ‖ x]; with `q_plain` (the queries before RoPE) the persistent keys are
        scored position-free, q_i · k_p (`position_free_prefix`)."""
        if q_plain is None:
            return segment_attention(q, keys, values, n_persistent, offset)
        q, keys = position_free_prefix(q, q_plain, keys[:, :, :n_persistent], keys[:, :, n_persistent:])
        return segment_attention(q, keys, values, n_persistent, offset, scale=self.head_dim**-0.5)

    def _with_persistent(self, keys: list[Tensor], values: list[Tensor], persistent: Optional[Tensor], x: Tensor
                         ) -> tuple[Tensor, Tensor]:
        """[p ‖ h ‖ x]'s keys and values from h's and x's (the persistent tokens' without rotation)."""
        if persistent is not None:
            k_p, v_p = self.project_keys(persistent.to(x.dtype)[None], None)
            keys = [k_p.expand(x.shape[0], -1, -1, -1), *keys]
            values = [v_p.expand(x.shape[0], -1, -1, -1), *values]
        return torch.cat(keys, 2), torch.cat(values, 2)

    def static_cache(self, cache: Optional[SegmentCache], clock: DecodeClock, like: Tensor) -> StaticSegmentCache:
        """`cache` (None: a segment's start) in buffers of `segment_len` slots; `like` `[batch, ...]` gives the batch,
        dtype and device."""
        shape = (like.shape[0], self.heads, self.segment_len, self.head_dim)
        buffers = [like.new_zeros(shape) for _ in range(4)]
        offset = cache.length if cache is not None else 0
        if cache is not None:
            for buffer, held in zip(buffers, (cache.k_h, cache.v_h, cache.k_x, cache.v_x)):
                buffer[:, :, :offset] = held
        return StaticSegmentCache(*buffers, clock, offset)

    def _static_step(self, x: Tensor, h: Tensor, persistent: Optional[Tensor], cache: StaticSegmentCache) -> Tensor:
        """`forward` for one token over a `StaticSegmentCache`: offset, slot and mask from the clock's device count."""
        one_token("SegmentAttention", x)
        offset = (cache.start_offset + cache.clock.device_steps) % self.segment_len  # [1]
        n_persistent = persistent.shape[0] if persistent is not None else 0
        q_plain, k_x, v_x = self.project(x, None)
        cos, sin = self.rope.angles(offset, q_plain.dtype)
        q, k_x = self.rope.rotate(q_plain, cos, sin), self.rope.rotate(k_x, cos, sin)
        k_h, v_h = self.project_keys(h, offset)
        for buffer, new in ((cache.k_h, k_h), (cache.v_h, v_h), (cache.k_x, k_x), (cache.v_x, v_x)):
            buffer.index_copy_(2, offset, new)
        keys, values = self._with_persistent([cache.k_h, cache.k_x], [cache.v_h, cache.v_x], persistent, x)
        visible = torch.arange(self.segment_len, device=x.device) <= offset
        mask = torch.cat([visible.new_ones(n_persistent), visible, visible])
        scale = None
        if self.position_free_persistent and n_persistent > 0:
            q, keys = position_free_prefix(q, q_plain, keys[:, :, :n_persistent], keys[:, :, n_persistent:])
            scale = self.head_dim**-0.5
        return self.merge(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None], scale=scale))
