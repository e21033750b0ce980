"""Causal depthwise 1-D convolution with a streaming cache (the short conv before q, k, v)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


def causal_depthwise_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                          cache: Optional[Tensor]) -> tuple[Tensor, Tensor]:
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
    # Weights cast like autocast would cast conv1d's.
    bias = bias.to(x.dtype) if bias is not None else None
    y = _ShiftedMultiplyAdd.apply(padded, weight.to(x.dtype), bias)
    return y, padded[:, padded.shape[1] - (kernel - 1) :]


class _ShiftedMultiplyAdd(torch.autograd.Function):
    """y = Σ_j padded[:, j : j + seq] ⊙ weight[:, j] (+ bias): K shifted multiply-adds. On CPU, forward and
    backward take half the time of conv1d's depthwise path. Its own backward because autograd's, through K
    slices and K `addcmul`s, zero-fills a padded-size gradient per tap and scales by each `addcmul`'s value
    (forward+backward at [4, 512, 768]: 11–12 ms with this one, 13–17 ms with autograd's). Written with
    differentiable ops, so double backward works."""

    @staticmethod
    def forward(ctx, padded: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:  # type: ignore[override]
        kernel = weight.shape[-1]
        seq = padded.shape[1] - kernel + 1
        y = padded[:, :seq] * weight[:, 0] if bias is None else torch.addcmul(bias, padded[:, :seq], weight[:, 0])
        for j in range(1, kernel):
            y.addcmul_(padded[:, j : j + seq], weight[:, j])
        ctx.save_for_backward(padded, weight)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        padded, weight = ctx.saved_tensors
        kernel = weight.shape[-1]
        seq = dy.shape[1]
        d_padded = d_weight = d_bias = None
        if ctx.needs_input_grad[0]:
            d_padded = dy.new_zeros(padded.shape)
            for j in range(kernel):
                d_padded[:, j : j + seq].addcmul_(dy, weight[:, j])
        if ctx.needs_input_grad[1]:
            d_weight = torch.stack([(dy * padded[:, j : j + seq]).sum((0, 1)) for j in range(kernel)], dim=1)
        if ctx.needs_input_grad[2]:  # False when there is no bias
            d_bias = dy.sum((0, 1))
        return d_padded, d_weight, d_bias


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
