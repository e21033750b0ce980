"""The one-token step (`memory/step.py`) against the chunk path it replaces in generation, in float64."""

import itertools

import pytest
import torch

from titans.memory import Gates, parallel_memory
from titans.memory import layer as layer_module
from titans.memory.decays import chunk_decays, last_row_decays
from titans.memory.mlp import backward_deltas, chunk_step_norm, forward_cached, last_step_norm
from titans.memory.step import memory_token_step

from .test_functional import make_inputs, max_diff, paper
from .test_layer import OPTION_SETS, make_memory, run_in_pieces

RULES = {
    "paper": {},
    "default": {"max_grad_norm": 4.0, "max_state_norm": 10.0, "normalize_chunk": True},
    # bounds tight enough to act on these inputs, and the hidden layers at ρ θ
    "bounds active": {"max_grad_norm": 0.3, "max_state_norm": 0.5, "normalize_chunk": True, "hidden_step": 0.4},
}


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
def test_last_row_decays_are_the_last_rows_of_the_chunk_decays(dtype, tolerance):
    """Every chunk length up to 9, with saturated gates among them (η = 0, α = 1: the log floor) in float32 too."""
    g = torch.Generator().manual_seed(3)
    eta, alpha = torch.rand(2, 3, 9, generator=g, dtype=dtype), 0.3 * torch.rand(2, 3, 9, generator=g, dtype=dtype)
    eta[0, 0, 2], alpha[1, 2, 4], eta[1, 1, 0] = 0.0, 1.0, 1.0
    for n in range(1, 10):
        full, row = chunk_decays(eta[..., :n], alpha[..., :n]), last_row_decays(eta[..., :n], alpha[..., :n])
        expected = (full.beta[..., -1], full.c[..., -1], (full.B @ full.E)[..., -1, :], full.E[..., -1, :],
                    full.e[..., -1])
        assert max_diff(row, expected) <= tolerance


def test_last_step_norm_is_the_last_row_of_the_chunk_step_norm():
    _, k, v, _, _, _, weights, _ = make_inputs(seq=7, depth=2)
    for n in range(1, 8):
        out, inputs, preacts = forward_cached(k[:, :, :n], weights, paper(residual=True))
        deltas = backward_deltas(out, v[:, :, :n], weights, preacts, paper(residual=True))
        assert (last_step_norm(inputs, deltas) - chunk_step_norm(inputs, deltas)[..., -1, :]).abs().max() <= 1e-15


@pytest.mark.parametrize("rule, depth, residual", list(itertools.product(RULES, [1, 2, 3], [True, False])))
def test_token_step_equals_the_chunk_path_at_every_token(rule, depth, residual):
    """Token t of a chunk of 5: its output from the step equals parallel_memory's over tokens 1..t (a ragged chunk
    whose last token is t), and at t = 5 so does the state after the chunk (bounded where the rule bounds it)."""
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=5, depth=depth, seed=depth)
    theta = 4 * theta  # steps large enough that the chunk's tokens move the memory well beyond round-off
    rule = paper(activation="silu" if depth == 3 else "gelu", residual=residual, **RULES[rule])
    for t in range(1, 6):
        chunk = [x[:, :, :t] for x in (k, v, theta, eta, alpha)]
        y, W, S = memory_token_step(q[:, :, t - 1 : t], *chunk[:2], Gates(*chunk[2:], None), weights, momentum, t == 5,
                                    rule)
        y_ref, W_ref, S_ref = parallel_memory(q[:, :, :t], *chunk[:2], Gates(*chunk[2:]), weights, momentum, rule=rule,
                                              chunk_size=5)
        assert (y - y_ref[:, :, -1:]).abs().max() <= 1e-13
        if t < 5:  # mid-chunk the state stays where the chunk started
            assert all(a is b for a, b in zip(W + S, weights + momentum))
        else:
            assert max_diff(W + S, W_ref + S_ref) <= 1e-13
            assert max_diff(W, weights) > 1e-3  # the chunk did move the memory


def test_token_step_takes_the_surprise_gate_at_the_chunk_start_weights():
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=4, depth=2)

    def surprise_theta(surprise, start, end):
        return 0.5 * torch.sigmoid(theta[:, :, start:end] - 0.7 * torch.log1p(surprise))

    y, W, S = memory_token_step(q[:, :, -1:], k, v, Gates(surprise_theta, eta, alpha, None), weights, momentum, True,
                                paper())
    y_ref, W_ref, S_ref = parallel_memory(q, k, v, Gates(surprise_theta, eta, alpha), weights, momentum, rule=paper(),
                                          chunk_size=4)
    assert max_diff([y, *W, *S], [y_ref[:, :, -1:], *W_ref, *S_ref]) <= 1e-13


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_generation_token_by_token_equals_one_call(name, monkeypatch):
    """Without autograd (as in `generate`) a token-by-token stream runs through the step (counted, so the test cannot
    pass on the chunk path alone) and equals one call: outputs, the state and what is left pending."""
    steps = []

    def counted(*args, **kwargs):
        steps.append(1)
        return memory_token_step(*args, **kwargs)

    monkeypatch.setattr(layer_module, "memory_token_step", counted)
    memory = make_memory(**OPTION_SETS[name])
    x = torch.randn(2, 23, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y, state = memory(x)
        y_tokens, state_tokens = run_in_pieces(memory, x, list(range(1, 23)))
    # the delta rule keeps its own (WY) path, and a channel-wise α the chunk path (the step takes the scalar α)
    own_path = OPTION_SETS[name].get("gradients") == "token" or OPTION_SETS[name].get("forgetting_channels", False)
    assert len(steps) == (0 if own_path else 23)
    assert (y_tokens - y).abs().max() <= 1e-12
    assert max_diff(state_tokens.weights + state_tokens.momentum, state.weights + state.momentum) <= 1e-12
    for field in ("pending_k", "pending_v", "pending_gates", "conv_cache"):  # (one row or 23: matmuls round apart)
        assert (getattr(state_tokens, field) - getattr(state, field)).abs().max() <= 1e-12, field
    assert state_tokens.seq_pos == 23 and state_tokens.num_pending == 23 % 4


def test_a_generated_state_continues_like_one_call():
    """A state the step left mid-chunk and at a chunk end continues through the chunk path (autograd on) exactly."""
    memory = make_memory()
    x = torch.randn(1, 15, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    y, _ = memory(x)
    for cut in (6, 8):  # mid-chunk, chunk end (chunk size 4)
        with torch.no_grad():
            y_head, state = run_in_pieces(memory, x[:, :cut], list(range(1, cut)))
        y_tail, _ = memory(x[:, cut:], state)
        assert (torch.cat([y_head, y_tail], 1) - y).abs().max() <= 1e-12


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_generation_at_other_chunk_sizes_equals_one_call(chunk_size):
    """Chunk size 1 ends a chunk (and bounds the state) at every token."""
    memory = make_memory(chunk_size=chunk_size, max_state_norm=0.3)
    x = torch.randn(1, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y, state = memory(x)
        y_tokens, state_tokens = run_in_pieces(memory, x, list(range(1, 10)))
    assert (y_tokens - y).abs().max() <= 1e-12
    assert max_diff(state_tokens.weights + state_tokens.momentum, state.weights + state.momentum) <= 1e-12
