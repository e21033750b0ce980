"""The fused memory (hand-written backward, pooled buffers) against the autograd dual form, in float64.

`test_functional.py` already holds both implementations to the token-by-token reference; here the fused
one is checked where its own machinery could go wrong: every option of the hand-written backward,
recomputation groups, the buffer pool shared by interleaved calls, and states that must not alias it.
"""

import itertools
import threading

import pytest
import torch

from titans.memory import Gates, fused, parallel_memory, release_workspace

from .test_functional import flat, gated, make_inputs, max_diff, paper


def outputs_and_grads(args, implementation, **kwargs):
    y, W, S = parallel_memory(*gated(args), implementation=implementation, **kwargs)
    outs = [y, *W, *S]
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    return outs, torch.autograd.grad(loss, flat(args))


@pytest.mark.parametrize(
    "depth, activation, residual, max_grad_norm",
    list(itertools.product([1, 2, 3], ["gelu", "silu"], [True, False], [None, 0.5])),
)
def test_fused_matches_autograd_values_and_gradients(depth, activation, residual, max_grad_norm):
    args = make_inputs(seq=23, depth=depth, requires_grad=True)
    # the bounded state rides along with the gradient bound (active at these inputs, ‖W_i‖ ≈ √d_out)
    max_state_norm = None if max_grad_norm is None else 0.7
    kwargs = dict(chunk_size=4, rule=paper(activation=activation, residual=residual, max_grad_norm=max_grad_norm,
                                           max_state_norm=max_state_norm))
    fused = outputs_and_grads(args, "fused", **kwargs)
    plain = outputs_and_grads(args, "autograd", **kwargs)
    assert max_diff(fused[0], plain[0]) <= 1e-10
    assert max_diff(fused[1], plain[1]) <= 1e-10
    if max_grad_norm is not None:  # the bound must be active for the test to cover its backward
        unbounded = parallel_memory(*gated(args), rule=paper(activation=activation, residual=residual), chunk_size=4)[0]
        assert (unbounded - fused[0][0]).abs().max() > 1e-3


@pytest.mark.parametrize("max_state_norm, group", [(0.7, None), (0.7, 2), (50.0, None)])
def test_bound_without_host_reads_changes_nothing(monkeypatch, max_state_norm, group):
    """On an accelerator the bounded state is measured and scaled every chunk instead of where a host read says it
    must be (no sync per chunk): the same values and gradients, to the bit, whether the bound acts (0.7) or never
    reaches the state (50), recomputation groups replaying the factors included. The Python chunk loop: the C++ one
    serves CPUs only, where the reads stay."""
    monkeypatch.setattr(fused, "NATIVE", False)
    args = make_inputs(seq=23, depth=2, requires_grad=True)
    kwargs = dict(chunk_size=4, rule=paper(max_grad_norm=0.5, max_state_norm=max_state_norm), checkpoint_chunks=group)
    reading = outputs_and_grads(args, "fused", **kwargs)
    monkeypatch.setattr(fused, "_without_host_reads", lambda t: True)
    always = outputs_and_grads(args, "fused", **kwargs)
    for a, b in zip([*reading[0], *reading[1]], [*always[0], *always[1]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("used", ["y", "states", "W_1"])
def test_outputs_the_loss_leaves_out_get_no_gradient(used):
    """The backward pass receives None, not zeros, for an output the loss does not use (usually the final state;
    the output y when only the state is carried on): it must treat None as zeros."""
    args = make_inputs(seq=23, depth=2, requires_grad=True)
    grads = []
    for implementation in ("fused", "autograd"):
        y, W, S = parallel_memory(*gated(args), rule=paper(), chunk_size=4, implementation=implementation)
        picked = {"y": [y], "states": [*W, *S], "W_1": [W[0]]}[used]
        loss = sum((o * o.detach().cos()).sum() for o in picked)
        got = torch.autograd.grad(loss, flat(args), allow_unused=True)
        grads.append([torch.zeros_like(x) if g is None else g for g, x in zip(got, flat(args))])
    assert max_diff(grads[0], grads[1]) <= 1e-10


def test_large_states_take_the_blas_dot_path():
    """States of 64k elements or more per (batch, head) use per-batch BLAS dots for the decay gradients."""
    args = make_inputs(batch=2, heads=1, seq=10, dim=64, hidden=1024, requires_grad=True)
    assert args[6][0][0, 0].numel() >= 1 << 16
    fused = outputs_and_grads(args, "fused", chunk_size=4)
    plain = outputs_and_grads(args, "autograd", chunk_size=4)
    assert max_diff(fused[0], plain[0]) <= 1e-10
    assert max_diff(fused[1], plain[1]) <= 1e-10


@pytest.mark.parametrize("seq, chunk_size, group", [(16, 4, 1), (23, 4, 2), (23, 4, 3), (30, 7, 2), (5, 8, 1)])
@pytest.mark.parametrize("hidden_step", [1.0, 0.3])
def test_recomputation_groups_do_not_change_gradients(seq, chunk_size, group, hidden_step):
    """Groups of `group` chunks recomputed in the backward pass, ragged tails included, against no groups; with the
    paper's rule and with the hidden layers at ρ θ."""
    args = make_inputs(seq=seq, depth=2, requires_grad=True)
    grouped = outputs_and_grads(args, "fused", rule=paper(hidden_step=hidden_step), chunk_size=chunk_size,
                                checkpoint_chunks=group)
    plain = outputs_and_grads(args, "autograd", rule=paper(hidden_step=hidden_step), chunk_size=chunk_size)
    assert max_diff(grouped[0], plain[0]) <= 1e-10
    assert max_diff(grouped[1], plain[1]) <= 1e-10


def test_gradcheck_with_groups_and_a_ragged_tail():
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(batch=1, heads=2, seq=7, dim=2, hidden=3,
                                                                requires_grad=True)

    def fn(q, k, v, theta, eta, alpha, w1, w2, s1, s2):
        y, W, S = parallel_memory(q, k, v, Gates(theta, eta, alpha), (w1, w2), (s1, s2),
                                  rule=paper(activation="silu", max_grad_norm=0.8), chunk_size=2, checkpoint_chunks=2)
        return (y, *W, *S)

    assert torch.autograd.gradcheck(fn, (q, k, v, theta, eta, alpha, *weights, *momentum), eps=1e-6, atol=1e-7)


def test_interleaved_calls_share_the_pool_safely():
    """Two layers' forward passes, then their backward passes in reverse order (as in a stacked model):
    one call keeps its states in a pooled buffer until its backward pass while the other recomputes in
    pooled buffers; neither may see the other's data."""
    first = make_inputs(seq=20, depth=2, seed=1, requires_grad=True)
    second = make_inputs(seq=20, depth=2, seed=2, requires_grad=True)
    y1 = parallel_memory(*gated(first), rule=paper(), chunk_size=4)[0]
    y2 = parallel_memory(*gated(second), rule=paper(), chunk_size=4, checkpoint_chunks=2)[0]
    probe = torch.randn(y1.shape, generator=torch.Generator().manual_seed(1), dtype=y1.dtype)
    grads2 = torch.autograd.grad((y2 * probe).sum(), flat(second))
    grads1 = torch.autograd.grad((y1 * probe).sum(), flat(first))
    for args, grads in ((first, grads1), (second, grads2)):
        y = parallel_memory(*gated(args), rule=paper(), chunk_size=4, implementation="autograd")[0]
        assert max_diff(grads, torch.autograd.grad((y * probe).sum(), flat(args))) <= 1e-10


def test_returned_states_do_not_alias_the_pool():
    args = make_inputs(seq=24, depth=2)
    with torch.no_grad():
        y, W, S = parallel_memory(*gated(args), rule=paper(), chunk_size=4)
        kept = [t.clone() for t in (y, *W, *S)]
        parallel_memory(*gated(make_inputs(seq=24, depth=2, seed=3)), rule=paper(), chunk_size=4)  # reuses the pool
    assert max_diff([y, *W, *S], kept) == 0


def test_no_grad_and_recorded_forward_agree():
    args = make_inputs(seq=21, depth=3, requires_grad=True)
    with torch.no_grad():
        free = parallel_memory(*gated(args), rule=paper(), chunk_size=4)
    recorded = parallel_memory(*gated(args), rule=paper(), chunk_size=4, checkpoint_chunks=2)
    assert max_diff([free[0], *free[1], *free[2]], [recorded[0], *recorded[1], *recorded[2]]) == 0


def test_broadcast_initial_weights_receive_summed_gradients():
    """NeuralMemory shares learned initial weights across the batch with `expand` (stride 0)."""
    q, k, v, theta, eta, alpha, weights, _ = make_inputs(seq=12, depth=2)
    shared = [w[:1, :1].clone().requires_grad_() for w in weights]
    expanded = tuple(w.expand_as(ref) for w, ref in zip(shared, weights))
    grads = []
    for implementation in ("fused", "autograd"):
        y, W, _ = parallel_memory(q, k, v, Gates(theta, eta, alpha), expanded, rule=paper(), chunk_size=4,
                                  implementation=implementation)
        grads.append(torch.autograd.grad((y**2).sum() + W[1].sum(), shared))
    assert max_diff(*grads) <= 1e-10


def _grad_into(out: list, loss: torch.Tensor, inputs: list) -> None:
    out.append(torch.autograd.grad(loss, inputs))


def test_backward_on_another_thread_returns_buffers_to_the_forward():
    """Autograd runs CUDA backward passes on its own thread. The buffers a forward pass keeps for its backward
    must come back to the next forward wherever the backward ran: the pool must not grow step after step."""
    release_workspace()
    args = make_inputs(seq=24, depth=2, requires_grad=True)
    reference = torch.autograd.grad(parallel_memory(*gated(args), rule=paper(), chunk_size=4,
                                                    implementation="autograd")[0].sum(),
                                    flat(args))
    pooled = []
    for _ in range(4):
        y = parallel_memory(*gated(args), rule=paper(), chunk_size=4)[0]
        grads = []
        worker = threading.Thread(target=_grad_into, args=(grads, y.sum(), flat(args)))
        worker.start()
        worker.join()
        assert max_diff(grads[0], reference) <= 1e-10
        pooled.append(sum(len(bufs) for bufs in fused._pool.values()))
    # back in the pool: the kept states and the backward's workspace; the same two, every step
    assert pooled == [2] * 4


def test_inference_mode_buffers_never_reach_a_normal_call():
    """Buffers made under inference_mode are inference tensors, which may not be written outside it: evaluating
    under inference_mode, then training, must work."""
    args = make_inputs(seq=12, depth=2, requires_grad=True)
    with torch.inference_mode():
        evaluated = parallel_memory(*gated(args), rule=paper(), chunk_size=4)[0]
    y = parallel_memory(*gated(args), rule=paper(), chunk_size=4)[0]
    grads = torch.autograd.grad(y.sum(), flat(args))
    reference = parallel_memory(*gated(args), rule=paper(), chunk_size=4, implementation="autograd")[0]
    assert max_diff([y, evaluated], [reference, reference.detach()]) <= 1e-12
    assert max_diff(grads, torch.autograd.grad(reference.sum(), flat(args))) <= 1e-10


def test_double_backward_is_refused_even_for_a_loss_linear_in_y():
    """A loss linear in y gets no grad-requiring incoming gradient, so `once_differentiable` alone would hand back
    a silent zero second derivative."""
    args = make_inputs(seq=8, depth=2, requires_grad=True)
    y = parallel_memory(*gated(args), rule=paper(), chunk_size=4)[0]
    with pytest.raises(RuntimeError, match="implementation='autograd'"):
        torch.autograd.grad((y * 2.0).sum(), args[3], create_graph=True)


def test_release_workspace_then_run_again():
    args = make_inputs(seq=12, depth=2)
    before = parallel_memory(*gated(args), rule=paper(), chunk_size=4)[0]
    release_workspace()
    assert torch.equal(parallel_memory(*gated(args), rule=paper(), chunk_size=4)[0], before)


def test_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="implementation"):
        parallel_memory(*gated(make_inputs(seq=4)), rule=paper(), implementation="cuda")


@pytest.mark.parametrize("depth, seed, normalize_chunk", [(1, 0, False), (2, 1, False), (3, 2, False), (2, 3, True)])
def test_norm_bound_bounds_every_chunk_end_from_above(depth, seed, normalize_chunk):
    """The bounded state reads a state's norm only where `_next_norm_bound` says it may reach its ball: that bound must
    never fall below the true norm, chunk after chunk (here no ball is reached, so the bound only grows)."""
    from titans.memory.fused import (
        ScanConfig,
        ScanInputs,
        _block_decays,
        _chunk_forward,
        _decays_of,
        _next_norm_bound,
        _state_norms,
    )

    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=32, depth=depth, seed=seed)
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v, theta, eta, alpha)]
    state = [t.reshape(-1, *t.shape[2:]) for pair in zip(weights, momentum) for t in pair]
    cfg = ScanConfig(chunk_size=4, rule=paper(residual=True, max_state_norm=1e6, normalize_chunk=normalize_chunk),
                     group_chunks=None, record=False)
    blocks = _block_decays(flat[4], flat[5], 4)
    bound, y = _state_norms(state), torch.empty_like(flat[2])
    for j in range(8):
        nxt = [torch.empty_like(t) for t in state]
        sl = slice(4 * j, 4 * j + 4)
        dec = _decays_of(blocks, j)
        cache = _chunk_forward(cfg, state, ScanInputs(*flat[:4], None).span(4 * j, 4 * j + 4), dec, y[:, sl], nxt)
        bound = _next_norm_bound(cache, dec, bound)
        assert (bound >= _state_norms(nxt) * (1 - 1e-12)).all()
        state = nxt
