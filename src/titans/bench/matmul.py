"""What bounds the memory's chunk matmuls: an n-row product against a state matrix, from cache and from DRAM.

The fused memory path spends most of a training step in products of a chunk's n rows (n = chunk size) with
state matrices `[batch, d_in, d_out]` (docs/PERFORMANCE.md). This measures one such product `x W` in both
orientations of the state, once with a single matrix reused (it stays in cache) and once cycling through
enough distinct matrices that each comes from DRAM, beside the rate at which the machine streams memory; each
with ATen's `bmm` (MKL) and, where they are built, with our kernel (`state_ops.xw`, what the fused scan uses).
If the DRAM product reads far fewer GiB/s than the stream, it waits on latency, not on bandwidth.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..memory import state_ops


@dataclass
class MatmulPoint:
    shape: str  # "[n×K]·[K×N]"
    implementation: str  # "ATen bmm" | "titans kernel"
    source: str  # "cache" | "DRAM"
    micros: float  # per product, whole batch
    gflops: float
    state_gib_s: float  # state bytes read per second


def _best_seconds(fn: Callable[[], None], calls: int, repeats: int) -> float:
    fn()  # warm-up: first touch, MKL's buffers
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _product_next(product: Callable[..., torch.Tensor], x: torch.Tensor, supply: Iterator[torch.Tensor],
                  out: torch.Tensor) -> None:
    product(x, next(supply), out=out)


def stream_gib_s(mib: int, repeats: int) -> float:
    """Read bandwidth: `sum` over a float32 tensor of `mib` MiB (larger than the caches)."""
    x = torch.ones(mib * 2**20 // 4)
    return mib / 1024 / _best_seconds(lambda: x.sum(), 1, repeats)


def implementations(x: torch.Tensor, W: torch.Tensor) -> dict[str, Callable[..., torch.Tensor]]:
    """ATen's bmm, and our kernel where the scan would use it for these operands (`state_ops.kernels_for`)."""
    found: dict[str, Callable[..., torch.Tensor]] = {"ATen bmm": torch.bmm}
    if state_ops.kernels_for(W, x) is not None:
        found["titans kernel"] = state_ops.xw
    return found


def measure(rows: int, d_in: int, d_out: int, batch: int, dram_mib: int, repeats: int) -> list[MatmulPoint]:
    """`[batch, rows, K]·[batch, K, N]` for (K, N) = (d_in, d_out) and (d_out, d_in), from cache and DRAM, with
    each implementation."""
    points = []
    state_bytes = batch * d_in * d_out * 4
    count = max(2, -(-dram_mib * 2**20 // state_bytes))  # enough distinct states to overflow the caches
    for K, N in ((d_in, d_out), (d_out, d_in)):
        states = [torch.randn(batch, K, N) for _ in range(count)]
        x = torch.randn(batch, rows, K)
        out = torch.empty(batch, rows, N)
        for name, product in implementations(x, states[0]).items():
            # cache: the same state every call; DRAM: each call the next of `count` states
            for source, supply, calls in (("cache", itertools.repeat(states[0]), 8),
                                          ("DRAM", itertools.cycle(states), count)):
                seconds = _best_seconds(functools.partial(_product_next, product, x, supply, out), calls, repeats)
                points.append(MatmulPoint(f"[{rows}×{K}]·[{K}×{N}]", name, source, seconds * 1e6,
                                          2 * batch * rows * K * N / seconds / 1e9, state_bytes / seconds / 2**30))
    return points


def format_table(points: list[MatmulPoint]) -> str:
    lines = ["| product (each batch element) | implementation | state from | µs per batch | GFLOP/s "
             "| state read GiB/s |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {p.shape} | {p.implementation} | {p.source} | {p.micros:.0f} | {p.gflops:.0f} "
              f"| {p.state_gib_s:.1f} |" for p in points]
    return "\n".join(lines)
