"""Causal depthwise 1-D convolution with a streaming cache (the short conv before q, k, v)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


def causal_depthwise_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], cache: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """y_t = Σ_{j<K} weight[:, j] · x_{t-K+1+j} (+ bias) per channel, over x `[batch, seq, channels]`.

    `cache` holds the last K−1 inputs of the previous call (zeros at the stream start), so feeding a
    stream in pieces gives the same output as one call. Returns (y, new cache).
    """
    kernel = weight.shape[-1]
    if cache is None:
        cache = x.new_zeros(x.shape[0], kernel - 1, x.shape[2])
    if x.shape[1] == 0:  # an empty piece of the stream: nothing to convolve, the cache carries over unchanged
        return x.new_zeros(x.shape[0], 0, weight.shape[0]), cache.to(x.dtype)
    padded = torch.cat([cache.to(x.dtype), x], dim=1)
    # K shifted multiply-adds: on CPU, forward and backward together take half the time of conv1d's depthwise
    # path (13 against 19–27 ms at [4, 512, 768], kernel 4). Weights cast like autocast would cast conv1d's.
    seq, weight = x.shape[1], weight.to(x.dtype)
    y = padded[:, :seq] * weight[:, 0] if bias is None else torch.addcmul(bias.to(x.dtype), padded[:, :seq], weight[:, 0])
    for j in range(1, kernel):
        y = torch.addcmul(y, padded[:, j : j + seq], weight[:, j])
    return y, padded[:, padded.shape[1] - (kernel - 1) :]


class CausalDepthwiseConv(nn.Module):
    """Module wrapper: one kernel of length `kernel` per channel, initialised close to identity."""

    def __init__(self, channels: int, kernel: int = 4):
        super().__init__()
        if kernel < 1:
            raise ValueError(f"kernel must be >= 1, got {kernel}")
        self.kernel = kernel
        # Start as the identity (last tap 1) plus small noise: the projection's output passes through
        # unchanged at initialisation and the conv learns how much local context to mix in.
        weight = torch.randn(channels, kernel) * 0.02
        weight[:, -1] += 1.0
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor, cache: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        return causal_depthwise_conv(x, self.weight, self.bias, cache)
