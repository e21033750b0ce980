"""parallel_memory (chunk-parallel dual form) against the token-by-token reference, in float64."""

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

from titans.memory import Gates, MemoryRule, memory_apply, parallel_memory, sequential_memory
from titans.memory.decays import chunk_decays

DT = torch.float64
# The paper's rule with `changes` (the functional core's default is the library's stable rule): what these tests hold
# each implementation to, switch by switch.
paper = MemoryRule.paper
# parallel_memory has two implementations of the same dual form: the fused one (hand-written backward,
# the default) and the autograd one; every exactness test below runs on both.
IMPLEMENTATIONS = ["fused", "autograd"]


def make_inputs(batch=2, heads=2, seq=21, dim=4, depth=2, hidden=8, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, heads, seq, dim, generator=g, dtype=DT), dim=-1)
    k = F.normalize(torch.randn(batch, heads, seq, dim, generator=g, dtype=DT), dim=-1)
    v = torch.randn(batch, heads, seq, dim, generator=g, dtype=DT)
    theta = 0.1 * torch.rand(batch, heads, seq, generator=g, dtype=DT)
    eta = 0.8 * torch.rand(batch, heads, seq, generator=g, dtype=DT)
    alpha = 0.2 * torch.rand(batch, heads, seq, generator=g, dtype=DT)
    widths = [dim] + [hidden] * (depth - 1) + [dim]
    weights = tuple(
        torch.randn(batch, heads, a, b, generator=g, dtype=DT) / a**0.5 for a, b in zip(widths, widths[1:])
    )
    momentum = tuple(0.1 * torch.randn(w.shape, generator=g, dtype=DT) for w in weights)
    args = [q, k, v, theta, eta, alpha, weights, momentum]
    return with_grad(args) if requires_grad else args


def gated(args, loss_gate=None):
    """`make_inputs`' flat list (q, k, v, θ, η, α, weights[, momentum]) as the memory functions take it: the gates as
    one `Gates`."""
    q, k, v, theta, eta, alpha, *state = args
    return [q, k, v, Gates(theta, eta, alpha, loss_gate), *state]


def with_grad(args):
    """The arguments with requires_grad set on every tensor, also inside the weight and momentum tuples."""
    return [tuple(t.requires_grad_() for t in a) if isinstance(a, tuple) else a.requires_grad_() for a in args]


def flat(args):
    return [t for a in args for t in (a if isinstance(a, tuple) else (a,))]


def max_diff(xs, ys):
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


@pytest.mark.parametrize(
    "chunk_size, depth, activation, implementation",
    list(itertools.product([1, 3, 16], [1, 2, 3], ["gelu", "silu"], IMPLEMENTATIONS)),
)
def test_parallel_equals_sequential(chunk_size, depth, activation, implementation):
    # seq 37 leaves a ragged last chunk for chunk sizes 3 and 16
    args = make_inputs(seq=37, depth=depth)
    y_p, W_p, S_p = parallel_memory(*gated(args), rule=paper(activation=activation), chunk_size=chunk_size,
                                    implementation=implementation)
    y_s, W_s, S_s = sequential_memory(*gated(args), rule=paper(activation=activation), chunk_size=chunk_size)
    assert y_p.shape == (2, 2, 37, 4)
    assert max_diff([y_p, *W_p, *S_p], [y_s, *W_s, *S_s]) <= 1e-10


@pytest.mark.parametrize("residual, implementation", list(itertools.product([True, False], IMPLEMENTATIONS)))
def test_parallel_equals_sequential_without_residual_and_zero_momentum(residual, implementation):
    args = make_inputs(seq=19, depth=2)
    args[7] = None  # momentum starts at zero
    out_p = parallel_memory(*gated(args), rule=paper(residual=residual), chunk_size=4, implementation=implementation)
    out_s = sequential_memory(*gated(args), rule=paper(residual=residual), chunk_size=4)
    assert max_diff([out_p[0], *out_p[1], *out_p[2]], [out_s[0], *out_s[1], *out_s[2]]) <= 1e-10


@pytest.mark.parametrize("depth, width, implementation", list(itertools.product([1, 2], [3, 6], IMPLEMENTATIONS)))
def test_values_of_another_width_without_residual(depth, width, implementation):
    """Without the residual, M maps dim-d keys to width-w values: outputs, states and the gradients of every
    input (q and k keep their own width) agree with the reference."""
    args = make_inputs(seq=13, depth=depth, seed=3)
    g = torch.Generator().manual_seed(4)
    args[2] = torch.randn(2, 2, 13, width, generator=g, dtype=DT)
    last = args[6][-1]
    args[6] = (*args[6][:-1], torch.randn(*last.shape[:3], width, generator=g, dtype=DT) / last.shape[2] ** 0.5)
    args[7] = (*args[7][:-1], 0.1 * torch.randn(*last.shape[:3], width, generator=g, dtype=DT))
    args = with_grad(args)
    results = []
    for out in (parallel_memory(*gated(args), rule=paper(residual=False), chunk_size=4, implementation=implementation),
                sequential_memory(*gated(args), rule=paper(residual=False), chunk_size=4)):
        y, W, S = out
        loss = y.pow(2).sum() + sum((w * w).sum() for w in W) + sum(s.sum() for s in S)
        results.append([y, *W, *S, *torch.autograd.grad(loss, flat(args))])
    assert results[0][0].shape == (2, 2, 13, width)
    assert max_diff(results[0], results[1]) <= 1e-10


def test_chunk_size_one_is_the_plain_recurrence():
    """Depth-1 residual memory, chunk 1: eqs. 12-13 with the closed-form gradient 2 kᵀ(k + kW − v)."""
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=12, depth=1)
    W, S = weights[0], momentum[0]
    ys = []
    for t in range(12):
        kt, vt = k[:, :, t : t + 1], v[:, :, t : t + 1]
        grad = 2 * kt.transpose(-1, -2) @ (kt + kt @ W - vt)
        S = eta[:, :, t, None, None] * S - theta[:, :, t, None, None] * grad
        W = (1 - alpha[:, :, t, None, None]) * W + S
        ys.append(q[:, :, t : t + 1] + q[:, :, t : t + 1] @ W)
    y, W_p, S_p = parallel_memory(q, k, v, Gates(theta, eta, alpha), weights, momentum, rule=paper(residual=True),
                                  chunk_size=1)
    assert max_diff([y, W_p[0], S_p[0]], [torch.cat(ys, 2), W, S]) <= 1e-12


def test_gated_delta_rule_is_a_configuration():
    """η = 0, depth 1, no residual: W_t = (1 − α_t) W_{t−1} − 2 θ_t kᵀ(k W_{t−1} − v) (Gated DeltaNet)."""
    q, k, v, theta, _, alpha, weights, _ = make_inputs(seq=10, depth=1)
    eta = torch.zeros_like(theta)
    W = weights[0]
    ys = []
    for t in range(10):
        kt, vt = k[:, :, t : t + 1], v[:, :, t : t + 1]
        W = (1 - alpha[:, :, t, None, None]) * W - theta[:, :, t, None, None] * 2 * kt.transpose(-1, -2) @ (kt @ W - vt)
        ys.append(q[:, :, t : t + 1] @ W)
    y, W_p, _ = parallel_memory(q, k, v, Gates(theta, eta, alpha), weights, rule=paper(residual=False), chunk_size=1)
    assert max_diff([y, W_p[0]], [torch.cat(ys, 2), W]) <= 1e-12


def test_chunk_gradients_are_taken_at_the_chunk_start():
    """θ on the first token only: its gradient is taken at W⁰ whatever the chunk size, so chunks of 8 and of 1
    agree exactly. θ on the second token too: a chunk of 8 takes that gradient at W⁰, chunks of 1 at the weights
    after token 0, so every output from token 1 on differs."""
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=8, depth=2)
    first = torch.zeros_like(theta)
    first[..., 0] = theta[..., 0]
    runs = [parallel_memory(q, k, v, Gates(first, eta, alpha), weights, momentum, rule=paper(),
                            chunk_size=c) for c in (8, 1)]
    assert max_diff(flat(runs[0]), flat(runs[1])) <= 1e-12
    both = first.clone()
    both[..., 1] = theta[..., 1]
    y8, y1 = (parallel_memory(q, k, v, Gates(both, eta, alpha), weights, momentum, rule=paper(), chunk_size=c)[0]
              for c in (8, 1))
    assert max_diff([y8[:, :, :1]], [y1[:, :, :1]]) <= 1e-12
    assert (y8[:, :, 1:] - y1[:, :, 1:]).abs().amax(dim=-1).min() > 1e-8


@pytest.mark.parametrize("chunk_size, implementation", list(itertools.product([1, 4], IMPLEMENTATIONS)))
def test_gradients_match_the_reference(chunk_size, implementation):
    args = make_inputs(seq=11, depth=2, requires_grad=True)
    grads = []
    for fn in (functools.partial(parallel_memory, implementation=implementation), sequential_memory):
        y, W, S = fn(*gated(args), rule=paper(), chunk_size=chunk_size)
        loss = (y**2).sum() + sum((w**3).sum() for w in W) + sum(s.sum() for s in S)
        grads.append(torch.autograd.grad(loss, flat(args)))
    assert max_diff(*grads) <= 1e-10
    assert all(g.abs().sum() > 0 for g in grads[0])  # every input really receives a gradient


def test_surprise_gated_theta_matches_the_reference():
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=13, depth=2, requires_grad=True)

    def surprise_theta(surprise, start, end):
        return 0.5 * torch.sigmoid(theta[:, :, start:end] - 0.7 * torch.log1p(surprise))

    outs = []
    for fn in (parallel_memory, sequential_memory):
        y, W, S = fn(q, k, v, Gates(surprise_theta, eta, alpha), weights, momentum, rule=paper(), chunk_size=5)
        outs.append([y, *W, *S, *torch.autograd.grad(y.pow(2).sum(), [theta, k])])
    assert max_diff(*outs) <= 1e-10


@pytest.mark.parametrize("chunk_size, implementation", list(itertools.product([1, 4], IMPLEMENTATIONS)))
def test_bounded_gradient_norm_matches_the_reference(chunk_size, implementation):
    args = make_inputs(seq=13, depth=2, requires_grad=True)
    outs = []
    for fn in (functools.partial(parallel_memory, implementation=implementation), sequential_memory):
        y, W, S = fn(*gated(args), rule=paper(max_grad_norm=2.0), chunk_size=chunk_size)
        loss = (y**2).sum() + sum((w**3).sum() for w in W) + sum(s.sum() for s in S)
        outs.append([y, *W, *S, *torch.autograd.grad(loss, flat(args))])
    assert max_diff(*outs) <= 1e-10
    unbounded = parallel_memory(*gated(args), rule=paper(), chunk_size=chunk_size)[0]
    assert (unbounded - outs[0][0]).abs().max() > 1e-3  # the bound is active on these inputs


def test_bounded_gradient_norm_bounds_each_step():
    """η = 0, α = 0, chunk 1: W_t − W_{t−1} = −θ_t ∇ℓ_t scaled, so ‖ΔW_t‖ ≤ θ_t c, with equality when clipped."""
    q, k, v, theta, _, _, weights, _ = make_inputs(seq=9, depth=2)
    v = 10 * v  # large errors: every token's gradient exceeds the bound
    zeros = torch.zeros_like(theta)
    W = weights
    for t in range(9):
        sl = slice(t, t + 1)
        _, W_next, _ = parallel_memory(q[:, :, sl], k[:, :, sl], v[:, :, sl], Gates(theta[:, :, sl], zeros[:, :, sl],
                                       zeros[:, :, sl]), W, rule=paper(max_grad_norm=0.5), chunk_size=1)
        step = torch.sqrt(sum(((a - b) ** 2).sum((-1, -2)) for a, b in zip(W_next, W)))
        torch.testing.assert_close(step, 0.5 * theta[:, :, t], rtol=1e-12, atol=0)
        W = W_next


@pytest.mark.parametrize("chunk_size, group, implementation",
                         [(1, None, "fused"), (4, None, "fused"), (4, 2, "fused"), (1, None, "autograd"),
                          (4, 2, "autograd")])
def test_bounded_state_matches_the_reference(chunk_size, group, implementation):
    """The bounded state (W, S back on their balls at every chunk end, a ragged last chunk included), with and without
    recomputation groups: values and gradients as the token-by-token reference computes them."""
    args = make_inputs(seq=13, depth=2, requires_grad=True)
    bounds = dict(max_grad_norm=2.0, max_state_norm=0.6)  # ‖W_i‖ ≈ √d_out at these inputs: the ball is active
    outs = []
    for fn in (functools.partial(parallel_memory, implementation=implementation, checkpoint_chunks=group),
               sequential_memory):
        y, W, S = fn(*gated(args), rule=paper(**bounds), chunk_size=chunk_size)
        loss = (y**2).sum() + sum((w**3).sum() for w in W) + sum(s.sum() for s in S)
        outs.append([y, *W, *S, *torch.autograd.grad(loss, flat(args))])
    assert max_diff(*outs) <= 1e-10
    unbounded = parallel_memory(*gated(args), rule=paper(max_grad_norm=2.0), chunk_size=chunk_size)[0]
    assert (unbounded - outs[0][0]).abs().max() > 1e-3  # the ball is active on these inputs


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bounded_state_holds_whatever_the_gates(implementation):
    """θ at its largest, momentum that never decays, no forgetting, values 1000x too large: the paper's rule runs
    away (to NaN within 64 tokens, even in float64), the bounded state ends every chunk inside its ball."""
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=64, depth=3)
    worst = dict(v=1000 * v, theta=torch.ones_like(theta), eta=torch.ones_like(eta), alpha=torch.zeros_like(alpha))
    gates = (worst["theta"], worst["eta"], worst["alpha"])
    free = parallel_memory(q, k, worst["v"], Gates(*gates), weights, momentum, rule=paper(), chunk_size=4,
                           implementation=implementation)
    assert not all(torch.isfinite(w).all() for w in free[1])
    W, S = weights, momentum
    for start in range(0, 64, 4):  # chunk by chunk: every chunk end is inside the ball
        sl = slice(start, start + 4)
        y, W, S = parallel_memory(q[:, :, sl], k[:, :, sl], worst["v"][:, :, sl], Gates(*(g[:, :, sl] for g in gates)),
                                  W, S, rule=paper(max_state_norm=3.0), chunk_size=4, implementation=implementation)
        assert torch.isfinite(y).all()
        for x in (*W, *S):
            norm = torch.linalg.vector_norm(x, dim=(-2, -1))
            assert (norm <= 3.0 * x.shape[-1] ** 0.5 * (1 + 1e-12)).all()


@pytest.mark.parametrize(
    "chunk_size, depth, activation, bounded, group, implementation",
    [(4, 1, "gelu", False, None, "fused"), (4, 2, "silu", True, None, "fused"), (5, 3, "gelu", True, None, "fused"),
     (4, 2, "gelu", True, 2, "fused"), (16, 2, "gelu", False, None, "fused"), (4, 1, "gelu", False, None, "autograd"),
     (5, 2, "silu", True, 2, "autograd"), (16, 3, "gelu", True, None, "autograd")],
)
def test_normalized_chunk_step_matches_the_reference(chunk_size, depth, activation, bounded, group, implementation):
    """The normalised chunk step (each token's step times G_ss / Σ_{r≤t} |G_sr|, a constant to the outer gradient),
    alone and with both bounds, ragged last chunks (seq 13) and recomputation groups: values and gradients as the
    token-by-token reference computes them from the gradients themselves."""
    args = make_inputs(seq=13, depth=depth, requires_grad=True)
    rule = dict(max_grad_norm=2.0, max_state_norm=0.6) if bounded else {}
    outs = []
    for fn in (functools.partial(parallel_memory, implementation=implementation, checkpoint_chunks=group),
               sequential_memory):
        y, W, S = fn(*gated(args), rule=paper(activation=activation, normalize_chunk=True, **rule),
                     chunk_size=chunk_size)
        loss = (y**2).sum() + sum((w**3).sum() for w in W) + sum(s.sum() for s in S)
        outs.append([y, *W, *S, *torch.autograd.grad(loss, flat(args))])
    assert max_diff(*outs) <= 1e-10
    plain = parallel_memory(*gated(args), rule=paper(activation=activation, **rule), chunk_size=chunk_size)[0]
    assert (plain - outs[0][0]).abs().max() > 1e-3  # the normalisation is active on these inputs


def test_normalized_chunk_step_leaves_chunk_size_one_alone():
    args = make_inputs(seq=9, depth=2)
    normalized = parallel_memory(*gated(args), rule=paper(normalize_chunk=True), chunk_size=1)
    plain = parallel_memory(*gated(args), rule=paper(), chunk_size=1)
    assert max_diff([normalized[0], *normalized[1]], [plain[0], *plain[1]]) == 0.0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_normalized_chunk_of_one_repeated_pair_moves_like_one_token(implementation):
    """n copies of one (k, v) in a chunk have n equal gradients: each takes 1/n of its step, so (η = α = 0) the chunk
    moves the memory exactly as one copy alone, where the paper's rule moves it n times as far."""
    q, k, v, theta, _, _, weights, _ = make_inputs(seq=8, depth=2)
    repeat = lambda x: x[:, :, :1].expand_as(x).contiguous()  # noqa: E731
    k, v, theta = repeat(k), repeat(v), repeat(theta)
    zeros = torch.zeros_like(theta)
    first = (slice(None), slice(None), slice(0, 1))
    once = parallel_memory(q[first], k[first], v[first], Gates(theta[first], zeros[first], zeros[first]), weights,
                           rule=paper(), chunk_size=8, implementation=implementation)
    chunk = parallel_memory(q, k, v, Gates(theta, zeros, zeros), weights, rule=paper(normalize_chunk=True),
                            chunk_size=8, implementation=implementation)
    assert max_diff(chunk[1], once[1]) <= 1e-12
    summed = parallel_memory(q, k, v, Gates(theta, zeros, zeros), weights, rule=paper(), chunk_size=8,
                             implementation=implementation)
    steps = [torch.linalg.vector_norm(a - w) for a, w in zip(summed[1], weights)]
    assert all(torch.isclose(s, 8 * torch.linalg.vector_norm(b - w)) for s, b, w in zip(steps, once[1], weights))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_normalized_chunk_of_similar_keys_does_not_overshoot(implementation):
    """A linear memory, a chunk of 16 keys at cosine ~0.8 with their own values, θ = 0.25 (each key alone would halve
    its error, 1 − 2θ‖k‖²): the paper's sum of the chunk's gradients overshoots, its loss on the chunk's own pairs
    grows; with the normalised step it falls."""
    g = torch.Generator().manual_seed(3)
    common = torch.randn(1, 1, 1, 8, generator=g, dtype=DT)
    k = F.normalize(common + 0.35 * torch.randn(1, 1, 16, 8, generator=g, dtype=DT), dim=-1)
    v = F.normalize(torch.randn(1, 1, 16, 8, generator=g, dtype=DT), dim=-1)
    cos = (k[0, 0] @ k[0, 0].T)[~torch.eye(16, dtype=torch.bool)].mean()
    assert cos > 0.8
    theta, zeros = torch.full((1, 1, 16), 0.25, dtype=DT), torch.zeros(1, 1, 16, dtype=DT)
    weights = (torch.zeros(1, 1, 8, 8, dtype=DT),)

    def loss(W):
        return ((memory_apply(k, W, paper()) - v) ** 2).sum().item()

    kwargs = dict(chunk_size=16, implementation=implementation)
    summed = parallel_memory(k, k, v, Gates(theta, zeros, zeros), weights, rule=paper(), **kwargs)[1]
    normalized = parallel_memory(k, k, v, Gates(theta, zeros, zeros), weights, rule=paper(normalize_chunk=True),
                                 **kwargs)[1]
    assert loss(summed) > loss(weights)
    assert loss(normalized) < loss(weights)


@pytest.mark.parametrize(
    "hidden_step, chunk_size, depth, rule",
    [(0.3, 4, 2, {}), (0.0, 5, 2, {}), (0.3, 1, 3, {}), (0.5, 4, 3, dict(normalize_chunk=True, max_grad_norm=2.0)),
     (0.3, 16, 2, dict(normalize_chunk=True, max_grad_norm=2.0, max_state_norm=0.6)), (0.3, 4, 1, {})],
)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_hidden_layer_step_matches_the_reference(hidden_step, chunk_size, depth, rule, implementation):
    """ρ θ_t on every layer but the last, the bounds computed from the whole gradient: values and gradients as the
    token-by-token reference computes them, on both chunk paths; depth 1 has no hidden layer, so ρ changes nothing
    there."""
    args = make_inputs(seq=13, depth=depth, requires_grad=True)
    outs = []
    for fn in (functools.partial(parallel_memory, implementation=implementation), sequential_memory):
        y, W, S = fn(*gated(args), rule=paper(hidden_step=hidden_step, **rule), chunk_size=chunk_size)
        loss = (y**2).sum() + sum((w**3).sum() for w in W) + sum(s.sum() for s in S)
        outs.append([y, *W, *S, *torch.autograd.grad(loss, flat(args))])
    assert max_diff(*outs) <= 1e-10
    every_layer = parallel_memory(*gated(args), rule=paper(**rule), chunk_size=chunk_size)[0]
    assert ((every_layer - outs[0][0]).abs().max() > 1e-3) == (depth > 1)


def test_hidden_step_zero_keeps_the_hidden_layers():
    """ρ = 0, no forgetting, no momentum carried in: the hidden layers end as they began, the last layer learned."""
    q, k, v, theta, eta, alpha, weights, _ = make_inputs(seq=13, depth=3)
    y, W, S = parallel_memory(q, k, v, Gates(theta, eta, torch.zeros_like(alpha)), weights, rule=paper(hidden_step=0.0),
                              chunk_size=4)
    for before, after, momentum in zip(weights[:-1], W[:-1], S[:-1]):
        assert torch.equal(before, after) and not momentum.any()
    assert (W[-1] - weights[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradcheck_tiny(implementation):
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(batch=1, heads=1, seq=5, dim=2, hidden=3,
                                                                requires_grad=True)

    def fn(q, k, v, theta, eta, alpha, w1, w2, s1, s2):
        y, W, S = parallel_memory(q, k, v, Gates(theta, eta, alpha), (w1, w2), (s1, s2), rule=paper(), chunk_size=2,
                                  implementation=implementation)
        return (y, *W, *S)

    inputs = (q, k, v, theta, eta, alpha, *weights, *momentum)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)

    def bounded(q, k, v, theta, eta, alpha, w1, w2, s1, s2):
        y, W, S = parallel_memory(q, k, v, Gates(theta, eta, alpha), (w1, w2), (s1, s2), rule=paper(max_grad_norm=1.0),
                                  chunk_size=2, implementation=implementation)
        return (y, *W, *S)

    assert torch.autograd.gradcheck(bounded, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_checkpointed_groups_give_identical_gradients(implementation):
    args = make_inputs(seq=40, depth=2, requires_grad=True)
    grads = []
    for checkpoint_chunks in (None, 2):
        y, W, S = parallel_memory(*gated(args), rule=paper(), chunk_size=4, checkpoint_chunks=checkpoint_chunks,
                                  implementation=implementation)
        grads.append(torch.autograd.grad((y**2).sum() + W[0].sum(), flat(args)))
    assert max_diff(*grads) <= 1e-12


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_causality_of_the_functional_core(implementation):
    """Changing every input of token j (q, k, v, θ, η, α) changes no output before j, and changes y_j on."""
    args = make_inputs(seq=20, depth=2)
    y = parallel_memory(*gated(args), rule=paper(), chunk_size=8, implementation=implementation)[0]
    g = torch.Generator().manual_seed(5)
    for j in (0, 5, 9, 19):
        changed = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
        for i in (0, 1):  # q, k: new unit vectors
            changed[i][:, :, j] = F.normalize(torch.randn(changed[i][:, :, j].shape, generator=g, dtype=DT), dim=-1)
        changed[2][:, :, j] += 1.0
        for i in (3, 4, 5):  # θ, η, α: new values in range
            changed[i][:, :, j] = 0.05 + 0.5 * torch.rand(changed[i][:, :, j].shape, generator=g, dtype=DT)
        y2 = parallel_memory(*gated(changed), rule=paper(), chunk_size=8, implementation=implementation)[0]
        assert torch.equal(y2[:, :, :j], y[:, :, :j])
        assert (y2[:, :, j:] - y[:, :, j:]).abs().max() > 1e-6


def test_state_is_float32_when_activations_are_bf16():
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=9, depth=2)
    lowp = [t.to(torch.bfloat16) for t in (q, k, v)]
    weights32 = tuple(w.float() for w in weights)
    y, W, S = parallel_memory(*lowp, Gates(theta.float(), eta.float(), alpha.float()), weights32, rule=paper(),
                              chunk_size=4)
    assert y.dtype == torch.bfloat16 and all(w.dtype == torch.float32 for w in W + S)


def test_memory_apply_shapes_and_residual():
    x = torch.randn(1, 1, 3, 4, dtype=DT)
    w = (torch.zeros(1, 1, 4, 4, dtype=DT),)
    assert torch.equal(memory_apply(x, w, paper(residual=True)), x)
    assert torch.equal(memory_apply(x, w, paper(residual=False)), torch.zeros_like(x))
    assert torch.equal(memory_apply(x, w), torch.zeros_like(x))  # the default rule: the paper's memory, no residual


def test_zero_gates_are_exact_limits():
    """α = 1 forgets everything before the token; η = 0 keeps no momentum (log-space floor, no NaN)."""
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=6, depth=1)
    alpha = torch.ones_like(alpha)
    eta = torch.zeros_like(eta)
    y, W, S = parallel_memory(q, k, v, Gates(theta, eta, alpha), weights, momentum, rule=paper(), chunk_size=3)
    y_ref, W_ref, S_ref = sequential_memory(q, k, v, Gates(theta, eta, alpha), weights, momentum, rule=paper(),
                                            chunk_size=3)
    assert torch.isfinite(y).all()
    assert max_diff([y, *W, *S], [y_ref, *W_ref, *S_ref]) <= 1e-12


def _nan_at_half(t):
    return t.masked_fill(t > t.median(), float("nan"))


# (argument the error must name, how the valid inputs are broken)
BAD_CASES = {
    "q shape": ("q", lambda a: a.__setitem__(0, a[0][..., :3])),
    "q dtype": ("q", lambda a: a.__setitem__(0, a[0].long())),
    "k dtype": ("k", lambda a: a.__setitem__(1, a[1].long())),
    "v seq": ("v", lambda a: a.__setitem__(2, a[2][:, :, :5])),
    "v dtype": ("v", lambda a: a.__setitem__(2, a[2].int())),
    "theta shape": ("theta", lambda a: a.__setitem__(3, a[3][:, :1])),
    "theta nan": ("theta", lambda a: a.__setitem__(3, _nan_at_half(a[3]))),
    "theta negative": ("theta", lambda a: a.__setitem__(3, -a[3])),
    "theta dtype": ("theta", lambda a: a.__setitem__(3, a[3].long())),
    "eta nan": ("eta", lambda a: a.__setitem__(4, _nan_at_half(a[4]))),
    "eta negative": ("eta", lambda a: a.__setitem__(4, a[4] - 1.0)),
    "alpha above one": ("alpha", lambda a: a.__setitem__(5, a[5] + 2.0)),
    "alpha nan": ("alpha", lambda a: a.__setitem__(5, _nan_at_half(a[5]))),
    "weights d_in": ("weights", lambda a: a.__setitem__(6, (a[6][0][..., :3, :], a[6][1]))),
    "weights mixed dtype": ("weights", lambda a: a.__setitem__(6, (a[6][0], a[6][1].float()))),
    "weights device": ("weights", lambda a: a.__setitem__(6, tuple(w.to("meta") for w in a[6]))),
    "momentum device": ("momentum", lambda a: a.__setitem__(7, tuple(m.to("meta") for m in a[7]))),
    "momentum count": ("momentum", lambda a: a.__setitem__(7, (a[7][0],))),
    "momentum dtype": ("momentum", lambda a: a.__setitem__(7, (a[7][0].float(), a[7][1].float()))),
}


@pytest.mark.parametrize("debug", [False, True])
def test_values_off_the_cpu_are_read_only_in_debug_mode(monkeypatch, debug):
    """Checking a gate's values reads them back from the device, a host sync on a GPU: off the CPU only the shapes
    are checked unless TITANS_CHECKS=1. (Meta tensors stand in for a GPU's: reading one back fails.)"""
    from titans.memory.checks import Gates, check_memory_args, checks_values

    monkeypatch.setenv("TITANS_CHECKS", "1" if debug else "0")
    q, k, v, theta, eta, alpha, weights, momentum = (
        t.to("meta") if isinstance(t, torch.Tensor) else tuple(x.to("meta") for x in t) for t in make_inputs(seq=7))
    assert checks_values(k) == debug and checks_values(torch.zeros(1))
    if debug:
        with pytest.raises(RuntimeError, match="meta"):
            check_memory_args(q, k, v, Gates(theta, eta, alpha, None), weights, momentum, 4, paper(residual=True))
    else:
        check_memory_args(q, k, v, Gates(theta, eta, alpha, None), weights, momentum, 4, paper(residual=True))
    with pytest.raises(ValueError, match="^theta"):  # the shapes are checked on every device
        check_memory_args(q, k, v, Gates(theta[:, :1], eta, alpha, None), weights, momentum, 4,
                          paper(residual=True))


@pytest.mark.parametrize("case", sorted(BAD_CASES))
@pytest.mark.parametrize("fn", [parallel_memory, sequential_memory])
def test_bad_input_names_the_argument(case, fn):
    name, spoil = BAD_CASES[case]
    args = make_inputs(seq=7)
    spoil(args)
    with pytest.raises(ValueError, match=rf"^{name}\b"):  # the message starts with the argument's name
        fn(*gated(args), rule=paper())


@pytest.mark.parametrize("bound", [1e-200, 1e160])
@pytest.mark.parametrize("fn", [parallel_memory, sequential_memory])
def test_max_grad_norm_out_of_the_state_dtypes_range(bound, fn):
    """A valid rule (any positive finite c), but beyond the range where c² is a normal number of the state's dtype
    (1e-200, 1e160 in float64) the bound would overflow or turn a zero gradient into 0 · ∞: the call refuses it."""
    with pytest.raises(ValueError, match="rule.max_grad_norm must lie in"):
        fn(*gated(make_inputs(seq=7)), rule=paper(max_grad_norm=bound))


@pytest.mark.parametrize("fn", [parallel_memory, sequential_memory])
def test_rule_must_be_a_memory_rule(fn):
    with pytest.raises(ValueError, match="^rule must be a MemoryRule"):
        fn(*gated(make_inputs(seq=7)), rule={"max_grad_norm": 1.0})


@pytest.mark.parametrize("fn", [parallel_memory, sequential_memory])
def test_the_gates_are_one_argument(fn):
    """θ, η, α (and the loss's gate) travel as one `Gates`: a call that gives them one by one is refused by name."""
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=7)
    with pytest.raises(TypeError, match=r"^gates must be titans.memory.Gates\(theta, eta, alpha, loss_gate=None\)"):
        fn(q, k, v, theta, weights)
    with pytest.raises(TypeError):
        fn(q, k, v, theta, eta, alpha, weights, momentum)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
@pytest.mark.parametrize("fn", [parallel_memory, sequential_memory])
def test_bad_chunk_size(chunk_size, fn):
    with pytest.raises(ValueError, match="^chunk_size"):
        fn(*gated(make_inputs(seq=7)), rule=paper(), chunk_size=chunk_size)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_saturated_gates_keep_gradients_finite_and_exact_elsewhere(implementation):
    """α = 1 or η = 0 exactly (saturated sigmoids) must not turn the outer gradients into NaN. The log-space
    decays give those two gates a zero gradient (documented); every other gradient matches the reference."""
    args = make_inputs(seq=8, depth=2)
    args[5] = args[5].clone()
    args[5][:, :, 3] = 1.0
    args[4] = args[4].clone()
    args[4][:, :, 5] = 0.0
    args = with_grad(args)
    results = []
    for fn in (functools.partial(parallel_memory, implementation=implementation), sequential_memory):
        y, W, _ = fn(*gated(args), rule=paper(), chunk_size=4)
        results.append(list(torch.autograd.grad(y.pow(2).sum() + W[0].sum(), flat(args))))
    (fast, ref), names = results, ["q", "k", "v", "theta", "eta", "alpha"]
    assert all(torch.isfinite(g).all() for g in fast)
    eta_at, alpha_at = names.index("eta"), names.index("alpha")
    assert (fast[eta_at][:, :, 5] == 0).all() and (fast[alpha_at][:, :, 3] == 0).all()
    for i in (eta_at, alpha_at):
        keep = torch.ones(8, dtype=torch.bool)
        keep[5 if i == eta_at else 3] = False
        fast[i], ref[i] = fast[i][:, :, keep], ref[i][:, :, keep]
    assert max_diff(fast, ref) <= 1e-10


def test_decays_keep_float32_precision_after_a_saturated_gate():
    """After a gate at the log floor, the decays of the following tokens must keep float32's precision (range sums,
    not differences of prefix sums near −1e4)."""
    alpha = torch.full((16,), 3e-4, dtype=torch.float64)
    alpha[2] = 1.0
    eta = torch.linspace(0.5, 0.99, 16, dtype=torch.float64)
    exact, single = chunk_decays(eta, alpha), chunk_decays(eta.float(), alpha.float())
    for x, y in zip(exact, single):
        assert ((y.double() - x).abs() <= 1e-6 * x.abs() + 1e-30).all()


def test_extreme_but_valid_gradient_bounds_stay_finite_on_zero_gradients():
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=8, depth=2)
    k, v = k.clone(), v.clone()
    k[:, :, 2], v[:, :, 2] = 0.0, 0.0  # padding: this token's gradient is exactly zero
    for bound in (1.5e-154, 1e-20, 1e150):
        y, W, S = parallel_memory(q, k, v, Gates(theta, eta, alpha), weights, momentum,
                                  rule=paper(residual=False, max_grad_norm=bound), chunk_size=4)
        assert all(torch.isfinite(t).all() for t in (y, *W, *S))


def channel_alpha(args, seed=1):
    """The arguments with α per channel: one [batch, heads, seq, d_out] gate per memory layer, in [0, 0.3)."""
    g = torch.Generator().manual_seed(seed)
    weights = args[6]
    alpha = tuple(0.3 * torch.rand(*args[5].shape, w.shape[-1], generator=g, dtype=DT) for w in weights)
    if args[5].requires_grad:
        alpha = tuple(a.requires_grad_() for a in alpha)
    return [*args[:5], alpha, *args[6:]]


@pytest.mark.parametrize(
    "chunk_size, depth, rule",
    [(1, 2, {}), (4, 1, {}), (5, 2, {}), (16, 3, {}),
     (4, 2, dict(normalize_chunk=True, max_grad_norm=2.0, max_state_norm=0.6, hidden_step=0.3))],
)
def test_channel_wise_forgetting_matches_the_reference(chunk_size, depth, rule):
    """α per output column of each layer (W_i ← W_i diag(1 − α_t,i) + S_i): values and gradients of every input
    as the token-by-token reference computes them, ragged last chunk included."""
    args = channel_alpha(make_inputs(seq=13, depth=depth, requires_grad=True))
    outs = []
    for fn in (parallel_memory, sequential_memory):
        y, W, S = fn(*gated(args), rule=paper(**rule), chunk_size=chunk_size)
        loss = (y**2).sum() + sum((w**3).sum() for w in W) + sum(s.sum() for s in S)
        outs.append([y, *W, *S, *torch.autograd.grad(loss, flat(args))])
    assert max_diff(*outs) <= 1e-10


def test_channel_wise_forgetting_with_equal_channels_is_the_scalar_gate():
    """Every channel at the same α_t is the paper's scalar forgetting gate (the fused path serves that one)."""
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=21, depth=2)
    same = tuple(alpha.unsqueeze(-1).expand(*alpha.shape, w.shape[-1]) for w in weights)
    scalar = parallel_memory(q, k, v, Gates(theta, eta, alpha), weights, momentum, rule=paper(), chunk_size=4)
    channels = parallel_memory(q, k, v, Gates(theta, eta, same), weights, momentum, rule=paper(), chunk_size=4)
    assert max_diff(flat(scalar), flat(channels)) <= 1e-12


def test_channel_wise_forgetting_forgets_only_its_channels():
    """α = 1 on one output column of the last layer and 0 elsewhere, no momentum carried: after the chunk that
    column holds only the chunk's own writes (β = 0 there), the other columns keep their start."""
    q, k, v, theta, eta, alpha, weights, _ = make_inputs(seq=4, depth=1)
    zero_theta = torch.zeros_like(theta)  # no writes: the state shows the forgetting alone
    forget = torch.zeros(*alpha.shape, weights[0].shape[-1], dtype=DT)
    forget[..., 1] = 1.0
    _, (W,), _ = parallel_memory(q, k, v, Gates(zero_theta, eta, (forget,)), weights, rule=paper(), chunk_size=4)
    assert torch.equal(W[..., 1], torch.zeros_like(W[..., 1]))
    assert max_diff([W[..., [0, 2, 3]]], [weights[0][..., [0, 2, 3]]]) <= 1e-15


@pytest.mark.parametrize("fn", [parallel_memory, sequential_memory])
def test_bad_channel_wise_alpha_names_the_layer(fn):
    args = channel_alpha(make_inputs(seq=7))
    wrong_width = [*args[:5], (args[5][0], args[5][1][..., :2]), *args[6:]]
    with pytest.raises(ValueError, match=r"^alpha\[1\] must have shape"):
        fn(*gated(wrong_width), rule=paper())
    with pytest.raises(ValueError, match="one tensor per memory layer"):
        fn(*gated([*args[:5], args[5][:1], *args[6:]]), rule=paper())
    above_one = [*args[:5], (args[5][0] + 2.0, args[5][1]), *args[6:]]
    with pytest.raises(ValueError, match=r"^alpha\[0\] must lie in \[0, 1\]"):
        fn(*gated(above_one), rule=paper())
