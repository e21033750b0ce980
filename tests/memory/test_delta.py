"""The exact gated delta rule (`delta.py`) against the token-by-token recurrence, in float64."""

import itertools

import pytest
import torch

from titans.memory import Gates, MemoryRule, delta_rule_memory, sequential_memory

from .test_functional import flat, make_inputs, max_diff, paper, with_grad


def delta(residual: bool = False) -> MemoryRule:
    """The rule the exact delta rule computes: per-token gradients, no momentum, no bounds, the squared loss."""
    return MemoryRule.paper(gradients="token", momentum=False, residual=residual)


def delta_inputs(seq=21, seed=0, requires_grad=False):
    q, k, v, theta, _, alpha, weights, _ = make_inputs(seq=seq, depth=1, seed=seed)
    theta = 3.0 * theta  # steps up to 0.3: the correction terms between tokens of a chunk matter
    args = [q, k, v, theta, alpha, weights]
    return with_grad(args) if requires_grad else args


def token_by_token(q, k, v, theta, alpha, weights, residual):
    """Chunks of one token: every gradient at the weights the previous token left (η = 0: no momentum)."""
    y, W, _ = sequential_memory(q, k, v, Gates(theta, torch.zeros_like(alpha), alpha), weights,
                                rule=paper(residual=residual),
                                chunk_size=1)
    return y, W


@pytest.mark.parametrize("chunk_size, residual", list(itertools.product([1, 3, 16, 64], [False, True])))
def test_equals_the_token_by_token_recurrence(chunk_size, residual):
    args = delta_inputs()  # 21 tokens: ragged last chunk for 3 and 16, one partial chunk for 64
    y, W = delta_rule_memory(*args, chunk_size=chunk_size, rule=delta(residual))
    y_ref, W_ref = token_by_token(*args, residual=residual)
    assert max_diff([y, *W], [y_ref, *W_ref]) <= 1e-12


@pytest.mark.parametrize("residual", [False, True])
def test_gradients_equal_the_recurrence(residual):
    args = delta_inputs(seq=11, requires_grad=True)
    probe = torch.Generator().manual_seed(2)
    grads = []
    for fn in (lambda *a: delta_rule_memory(*a, chunk_size=4, rule=delta(residual)),
               lambda *a: token_by_token(*a, residual=residual)):
        y, W = fn(*args)
        loss = (y * torch.randn(y.shape, generator=probe, dtype=y.dtype)).sum() + (W[0] ** 2).sum()
        grads.append(torch.autograd.grad(loss, flat(args)))
        probe.manual_seed(2)
    assert max_diff(*grads) <= 1e-10


def test_gradcheck():
    q, k, v, theta, alpha, weights = delta_inputs(seq=5, requires_grad=True)
    k = torch.nn.functional.normalize(k.detach(), dim=-1).requires_grad_()

    def fn(q, k, v, theta, alpha, W):
        y, (W_new,) = delta_rule_memory(q, k, v, theta, alpha, (W,), chunk_size=2)
        return y, W_new

    assert torch.autograd.gradcheck(fn, (q[:1, :1], k[:1, :1], v[:1, :1], theta[:1, :1], alpha[:1, :1],
                                         weights[0][:1, :1]))


def test_saturated_forgetting_and_long_streams_stay_exact_and_finite():
    q, k, v, theta, alpha, weights = delta_inputs(seq=40)
    alpha = alpha.clone()
    alpha[:, :, 7] = 1.0  # forget everything at token 7
    y, W = delta_rule_memory(q, k, v, theta, alpha, weights, chunk_size=16)
    y_ref, W_ref = token_by_token(q, k, v, theta, alpha, weights, residual=False)
    assert max_diff([y, *W], [y_ref, *W_ref]) <= 1e-12
    g = torch.Generator().manual_seed(0)
    n = 20_000
    long = [torch.nn.functional.normalize(torch.randn(1, 2, n, 8, generator=g), dim=-1) for _ in range(2)]
    y, (W,) = delta_rule_memory(long[0], long[1], torch.randn(1, 2, n, 8, generator=g), torch.full((1, 2, n), 0.5),
                                torch.full((1, 2, n), 1e-3), (torch.zeros(1, 2, 8, 8),), chunk_size=64)
    assert torch.isfinite(y).all() and torch.isfinite(W).all()


def test_bad_input_names_the_argument():
    q, k, v, theta, alpha, weights = delta_inputs(seq=7)
    with pytest.raises(ValueError, match="^weights"):
        delta_rule_memory(q, k, v, theta, alpha, (weights[0], weights[0]))
    with pytest.raises(ValueError, match="^theta"):
        delta_rule_memory(q, k, v, lambda s, a, b: s, alpha, weights)
    with pytest.raises(ValueError, match="^alpha"):
        delta_rule_memory(q, k, v, theta, alpha + 2.0, weights)
    with pytest.raises(ValueError, match="^chunk_size"):
        delta_rule_memory(q, k, v, theta, alpha, weights, chunk_size=0)


def test_refuses_a_rule_it_does_not_compute():
    """The exact delta rule takes its gradients per token; a chunk rule (or one with momentum, bounds or another loss,
    which `MemoryRule` already refuses with gradients='token') is `parallel_memory`'s, and the message says so."""
    q, k, v, theta, alpha, weights = delta_inputs(seq=7)
    with pytest.raises(ValueError, match="gradients='chunk' is parallel_memory's"):
        delta_rule_memory(q, k, v, theta, alpha, weights, rule=paper())
    with pytest.raises(ValueError, match=r"gradients='token'.*loss='huber'.*gradients='chunk' serves every rule"):
        MemoryRule.paper(gradients="token", momentum=False, loss="huber")


def test_the_momentum_gain_bound_is_applied_with_no_momentum():
    """κ bounds θ as everywhere; with η = 0 that is θ_t ≤ κ: the same as the delta rule at θ clipped by hand."""
    q, k, v, theta, alpha, weights = delta_inputs(seq=21)
    y, W = delta_rule_memory(q, k, v, theta, alpha, weights, chunk_size=4,
                             rule=delta().replace(max_momentum_step=0.1))
    y_ref, W_ref = delta_rule_memory(q, k, v, theta.clamp(max=0.1), alpha, weights, chunk_size=4, rule=delta())
    assert (theta > 0.1).any() and max_diff([y, *W], [y_ref, *W_ref]) == 0
