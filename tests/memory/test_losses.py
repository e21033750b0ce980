"""The inner loss (`memory/losses.py`, MIRAS's attentional biases) through every implementation, in float64.

Each loss's hand-written pieces (its gradient g, g' for the hand-written backward passes, ∂g/∂gate) against autograd of
its value; then every implementation that runs on a CPU (the fused scan with its chunk loop in C++ and in Python, the
autograd chunk path, the one-token step, `NeuralMemory`) against the token-by-token reference, which differentiates the
loss's *value* by autograd (`torch.func.grad`): outputs, end states and the gradients of every input, the loss's gate
included, chunk sizes 1, 4 and 16 with ragged last chunks, streams cut anywhere. And the registry's completeness: a loss
registered without its examples here, its C++ counterpart (or a refusal) and its Triton counterpart (or a refusal)
fails `test_every_registered_loss_has_its_reference_and_its_counterparts`.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from titans import TitansConfig, TitansLM
from titans.memory import (
    LOSSES,
    Gates,
    Huber,
    Lp,
    MemoryRule,
    Squared,
    fused,
    parallel_memory,
    sequential_memory,
    state_ops,
)
from titans.memory.fused import ScanConfig
from titans.memory.step import memory_token_step

from .test_functional import DT, flat, gated, make_inputs, max_diff, paper, with_grad
from .test_layer import make_memory, run_in_pieces

# Every registered loss, by name: the instances the reference tests below run (a loss without examples fails
# `test_every_registered_loss_has_its_reference_and_its_counterparts`). δ near the errors' size, so that both of
# Huber's pieces occur; p on both sides of 2.
EXAMPLES: dict[str, list] = {
    "squared": [Squared()],
    "huber": [Huber(delta=0.3), Huber(delta=0.3, gated=True)],
    "lp": [Lp(p=3.0), Lp(p=1.5, eps=1e-3)],
}
CASES = [loss for name in sorted(EXAMPLES) for loss in EXAMPLES[name]]
IDS = [f"{loss.name}{'-gated' if loss.has_gate else ''}{'-p' + str(loss.p) if loss.name == 'lp' else ''}"
       for loss in CASES]


def errors(seed: int = 0) -> torch.Tensor:
    """Errors e of every size around the losses' scales (δ = 0.3, ε), zero included."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(3, 5, 7, generator=g, dtype=DT) * 0.5
    e[0, 0, :3] = torch.tensor([0.0, 1e-4, -2.0], dtype=DT)
    return e


def gate_of(loss, e: torch.Tensor) -> torch.Tensor | None:
    """A per-token gate for a loss with one: δ_t between 0.1 and 0.5."""
    if not loss.has_gate:
        return None
    return 0.1 + 0.4 * torch.rand(e.shape[:-1], generator=torch.Generator().manual_seed(1), dtype=DT)


@pytest.mark.parametrize("loss", CASES, ids=IDS)
def test_each_loss_defines_its_gradient_and_derivatives_consistently(loss):
    """g = h' (the gradient the chunk paths use) is autograd of the value, g' is autograd of g, ∂g/∂gate too, and
    `backward` is their vector-Jacobian product; elementwise, away from Huber's two kinks."""
    e = errors().requires_grad_()
    gate = gate_of(loss, e)
    if gate is not None:
        gate = gate.requires_grad_()
        assert ((e.detach().abs() - gate.detach().unsqueeze(-1)).abs() > 1e-6).all()  # no error on a kink
    value = loss.value(e, gate)
    (grad,) = torch.autograd.grad(value.sum(), e, create_graph=True)
    assert max_diff([loss.grad(e, gate)], [grad]) <= 1e-12
    g = loss.grad(e, gate)
    d = torch.randn(e.shape, generator=torch.Generator().manual_seed(2), dtype=DT)
    auto = torch.autograd.grad((g * d).sum(), [e] + ([gate] if gate is not None else []))
    d_e, d_gate = loss.backward(d, e.detach(), None if gate is None else gate.detach())
    derivative = loss.grad_derivative(e.detach(), gate)
    assert max_diff([d_e, d * derivative], [auto[0], auto[0]]) <= 1e-12
    if gate is None:
        assert d_gate is None
    else:
        assert max_diff([d_gate, (d * loss.gate_derivative(e.detach(), gate.detach())).sum(-1)], [auto[1]] * 2) <= 1e-12


def test_the_squared_losss_arithmetic_is_the_librarys_before_losses_were_pluggable():
    e, d = errors(), errors(3)
    assert torch.equal(Squared().grad(e), 2.0 * e) and torch.equal(Squared().backward(d, None)[0], 2.0 * d)
    assert not Squared().needs_error and Squared().backward(d, None)[1] is None


def test_lp_at_two_has_exactly_the_squared_losss_gradient():
    """Σ (e² + ε): the squared loss plus a constant, its gradient 2 e (e² + ε)^0 = 2 e to the bit, and so is g'."""
    e, d = errors(), errors(3)
    lp = Lp(p=2.0, eps=1e-3)
    assert torch.equal(lp.grad(e), Squared().grad(e))
    assert torch.equal(lp.backward(d, e)[0], Squared().backward(d, e)[0])


def test_huber_is_squared_inside_and_its_step_is_bounded_outside():
    e = errors()
    huber = Huber(delta=0.3)
    inside = e.abs() <= 0.3
    assert torch.equal(huber.grad(e)[inside], 2.0 * e[inside]) and torch.equal(huber.value(e)[inside], (e**2)[inside])
    assert torch.equal(huber.grad(e)[~inside], 0.6 * torch.sign(e[~inside]))
    assert torch.equal(Huber(delta=1e6).grad(e), Squared().grad(e))  # a δ no error reaches: the squared loss
    gated = Huber(delta=0.3, gated=True)
    assert gated.gate_from_logit(torch.zeros(())) == 0.3  # δ_t = 2 δ sigmoid(logit): δ at initialisation
    assert gated.gate_from_logit(torch.tensor(50.0)) == pytest.approx(0.6)  # δ_max = 2 δ


def loss_inputs(loss, seq: int = 21, depth: int = 2, seed: int = 0) -> tuple[list, torch.Tensor | None]:
    """`make_inputs` with θ large enough that each chunk moves the memory, and the loss's gate where it has one."""
    args = make_inputs(seq=seq, depth=depth, seed=seed)
    args[3] = 1.5 * args[3]
    gate = None
    if loss.has_gate:
        gate = 0.1 + 0.4 * torch.rand(args[0].shape[:3], generator=torch.Generator().manual_seed(seed + 7), dtype=DT)
    return args, gate


def outputs_and_grads(fn, args, gate, **kwargs):
    """fn's outputs and the gradients of a random linear loss of them w.r.t. every input, the gate's included."""
    inputs = with_grad(args)
    gate = None if gate is None else gate.clone().requires_grad_()
    y, W, S = fn(*gated(inputs, gate), **kwargs)
    outs = [y, *W, *S]
    g = torch.Generator().manual_seed(1)
    probe = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    grads = torch.autograd.grad(probe, flat(inputs) + ([gate] if gate is not None else []))
    return outs, list(grads)


IMPLEMENTATIONS = ["fused", "fused-python", "autograd"]


@pytest.mark.parametrize("loss", CASES, ids=IDS)
@pytest.mark.parametrize("chunk_size", [1, 16])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_implementation_matches_the_reference(monkeypatch, loss, chunk_size, implementation):
    """The paper's rule with the loss: values, end states and every gradient (θ, η, α, q, k, v, W⁰, S⁰ and the loss's
    gate) as the token-by-token reference computes them from the loss's value; seq 21 leaves a ragged chunk of 5."""
    if implementation == "fused" and state_ops.kernels() is None:
        pytest.skip("the C++ chunk loop is not built here")
    if implementation == "fused-python":
        monkeypatch.setattr(fused, "NATIVE", False)
    args, gate = loss_inputs(loss)
    rule = paper(loss=loss)
    run = dict(chunk_size=chunk_size, implementation=implementation.removesuffix("-python"))
    got = outputs_and_grads(parallel_memory, args, gate, rule=rule, **run)
    ref = outputs_and_grads(sequential_memory, args, gate, rule=rule, chunk_size=chunk_size)
    assert max_diff(got[0], ref[0]) <= 1e-10
    assert max_diff(got[1], ref[1]) <= 1e-10
    if loss.name != "squared":  # the loss changes what the memory learns
        assert max_diff(got[0], outputs_and_grads(parallel_memory, args, None, rule=paper(), **run)[0]) > 1e-4


@pytest.mark.parametrize("loss", CASES, ids=IDS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_with_the_stable_rule_and_a_deep_silu_memory(monkeypatch, loss, implementation):
    """The loss beside the library's bounds (tight enough to act), the normalised chunk step, ρ and κ, at depth 3,
    chunks of 4 (recomputation groups of 2 in the fused scan): still the reference's numbers."""
    if implementation == "fused" and state_ops.kernels() is None:
        pytest.skip("the C++ chunk loop is not built here")
    if implementation == "fused-python":
        monkeypatch.setattr(fused, "NATIVE", False)
    args, gate = loss_inputs(loss, seq=13, depth=3, seed=1)
    rule = MemoryRule(loss=loss, activation="silu", max_grad_norm=0.5, max_state_norm=0.7, hidden_step=0.3,
                      max_momentum_step=0.4)
    extra = {"checkpoint_chunks": 2} if implementation != "autograd" else {}
    got = outputs_and_grads(parallel_memory, args, gate, rule=rule, chunk_size=4,
                            implementation=implementation.removesuffix("-python"), **extra)
    ref = outputs_and_grads(sequential_memory, args, gate, rule=rule, chunk_size=4)
    assert max_diff(got[0], ref[0]) <= 1e-10
    assert max_diff(got[1], ref[1]) <= 1e-10


@pytest.mark.parametrize("loss", [loss for loss in CASES if loss.name != "squared"],
                         ids=[i for i, loss in zip(IDS, CASES) if loss.name != "squared"])
def test_the_c_loop_equals_the_python_loop(monkeypatch, loss):
    """kernels/losses.h against losses.py, through the chunk loops (one slice and two), values and gradients to
    rounding."""
    if state_ops.kernels() is None:
        pytest.skip("the C++ chunk loop is not built here")
    args, gate = loss_inputs(loss, seq=21, depth=2, seed=2)
    rule = MemoryRule(loss=loss)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        native = outputs_and_grads(parallel_memory, args, gate, rule=rule, chunk_size=4, implementation="fused")
        monkeypatch.setattr(fused, "NATIVE", False)
        python = outputs_and_grads(parallel_memory, args, gate, rule=rule, chunk_size=4, implementation="fused")
    finally:
        torch.set_num_threads(threads)
    assert max_diff(native[0], python[0]) <= 1e-12 and max_diff(native[1], python[1]) <= 1e-12


@pytest.mark.parametrize("implementation", ["fused", "autograd"])
def test_lp_at_two_runs_exactly_as_the_squared_loss(implementation):
    args, _ = loss_inputs(Squared())
    lp = outputs_and_grads(parallel_memory, args, None, rule=paper(loss=Lp(p=2.0)), chunk_size=4,
                           implementation=implementation)
    squared = outputs_and_grads(parallel_memory, args, None, rule=paper(), chunk_size=4, implementation=implementation)
    assert all(torch.equal(a, b) for a, b in zip(lp[0] + lp[1], squared[0] + squared[1]))


def test_gradcheck_of_the_gated_huber_through_the_fused_scan():
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(batch=1, heads=1, seq=5, dim=2, hidden=3)
    theta = 3.0 * theta
    gate = torch.full((1, 1, 5), 0.4, dtype=DT)
    rule = paper(loss=Huber(delta=0.3, gated=True))

    def fn(k, v, theta, gate, w1, w2):
        y, W, S = parallel_memory(q, k, v, Gates(theta, eta, alpha, gate), (w1, w2), momentum, rule=rule, chunk_size=2,
                                  checkpoint_chunks=2)
        return (y, *W, *S)

    inputs = [t.clone().requires_grad_() for t in (k, v, theta, gate, *weights)]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss", CASES, ids=IDS)
def test_the_one_token_step_equals_the_chunk_path(loss):
    """Token t of a chunk of 5: the generation step's output equals parallel_memory's over tokens 1..t, and at t = 5
    so does the state after the chunk."""
    args, gate = loss_inputs(loss, seq=5, depth=2, seed=3)
    q, k, v, theta, eta, alpha, weights, momentum = args
    rule = MemoryRule(loss=loss, max_grad_norm=0.5, max_state_norm=0.7)
    for t in range(1, 6):
        chunk = [x[:, :, :t] for x in (k, v, theta, eta, alpha)]
        tokens_gate = None if gate is None else gate[:, :, :t]
        y, W, S = memory_token_step(q[:, :, t - 1:t], *chunk[:2], Gates(*chunk[2:], tokens_gate), weights, momentum,
                                    t == 5, rule)
        y_ref, W_ref, S_ref = parallel_memory(q[:, :, :t], *chunk[:2], Gates(*chunk[2:], tokens_gate), weights,
                                              momentum, rule=rule, chunk_size=5)
        assert (y - y_ref[:, :, -1:]).abs().max() <= 1e-13
        if t == 5:
            assert max_diff(W + S, W_ref + S_ref) <= 1e-13


LAYER_LOSSES = {"huber": {"name": "huber", "delta": 0.1}, "huber gated": {"name": "huber", "delta": 0.1, "gated": True},
                "lp": {"name": "lp", "p": 3.0}}


@pytest.mark.parametrize("name", sorted(LAYER_LOSSES))
@pytest.mark.parametrize("options", [{}, {"surprise_gate": True}, {"forgetting_channels": True, "depth": 3,
                                                                    "expansion": 2}],
                         ids=["default", "surprise gate", "channel-wise α, depth 3"])
def test_the_layer_streams_and_generates_exactly_and_matches_the_reference(name, options, monkeypatch):
    """NeuralMemory with the loss: a stream cut anywhere and token-by-token generation equal one call; the layer run
    through the token-by-token reference in place of the chunk path gives the same outputs and states; the gate's
    parameters (the loss's gate is one more gate per head) train."""
    from titans.memory import layer

    memory = make_memory(loss=LAYER_LOSSES[name], **options)
    assert memory.gates_per_head == 2 + sum(memory.alpha_widths) + (name == "huber gated")
    x = torch.randn(2, 23, 16, dtype=DT, generator=torch.Generator().manual_seed(4))
    y, state = memory(x)
    y.square().sum().backward()
    assert memory.to_gates.weight.grad.abs().sum() > 0
    if name == "huber gated":  # the δ_t logits' rows (the last gate of every head) receive a gradient
        assert memory.to_gates.weight.grad.view(memory.gates_per_head, 2, 16)[-1].abs().sum() > 0
    with torch.no_grad():
        for cuts in ([3, 4, 11, 12], list(range(1, 23))):
            y_cut, state_cut = run_in_pieces(memory, x, cuts)
            assert (y_cut - y).abs().max() <= 1e-12
            assert max_diff(state_cut.weights + state_cut.momentum, state.weights + state.momentum) <= 1e-12
    monkeypatch.setattr(layer, "parallel_memory", lambda *a, **kw: sequential_memory(
        *a, **{key: value for key, value in kw.items() if key not in ("checkpoint_chunks", "implementation")}))
    y_ref, state_ref = memory(x)
    assert (y_ref - y).abs().max() <= 1e-12
    assert max_diff(state_ref.weights + state_ref.momentum, state.weights + state.momentum) <= 1e-12


def test_bad_loss_gates_are_named():
    args, gate = loss_inputs(Huber(gated=True), seq=7)
    with_gate, plain = paper(loss=Huber(gated=True)), paper(loss="huber")
    with pytest.raises(ValueError, match=r"^loss_gate: the rule's loss \(huber, gated\) needs"):
        parallel_memory(*gated(args), rule=with_gate)
    with pytest.raises(ValueError, match=r"^loss_gate: the rule's loss \(huber\) takes no gate"):
        parallel_memory(*gated(args, gate), rule=plain)
    with pytest.raises(ValueError, match=r"^loss_gate must have shape \(2, 2, 7\)"):
        parallel_memory(*gated(args, gate[:, :, :3]), rule=with_gate)
    with pytest.raises(ValueError, match="^loss_gate must be >= 0"):
        parallel_memory(*gated(args, -gate), rule=with_gate)
    with pytest.raises(ValueError, match="^loss_gate contains NaN"):
        parallel_memory(*gated(args, gate * float("nan")), rule=with_gate)


def test_losses_in_the_config():
    """`memory.loss` takes a loss's mapping or its bare name; every bad field is named with its path."""
    assert MemoryRule(loss="lp").loss == Lp() and MemoryRule.from_dict({"loss": {"name": "huber"}}).loss == Huber()
    config = TitansConfig(variant="lmm", dim=16, heads=2, memory={"loss": {"name": "huber", "delta": 0.5,
                                                                           "gated": True}})
    assert config.memory.rule.loss == Huber(delta=0.5, gated=True)
    assert TitansConfig.from_dict(config.to_dict()) == config
    base = TitansLM(TitansConfig(variant="lmm", dim=16, heads=2, depth=1)).num_parameters()
    gated = TitansLM(TitansConfig(variant="lmm", dim=16, heads=2, depth=1, memory={"loss": "huber"})).num_parameters()
    assert gated == base  # an ungated loss adds nothing
    with_gate = TitansLM(config.replace(depth=1)).num_parameters()
    assert with_gate - base == 2 * 17  # one more gate per memory head, its weights and bias (the MLP as before)
    for bad, message in (({"name": "huber", "gated": 1}, "loss.gated: expected a valid boolean"),
                         ({"name": "lp", "p": 1.0}, r"loss.p: must be > 1"), ({"name": "lp", "eps": 0}, "loss.eps"),
                         ({"name": "squared", "delta": 1}, "loss.delta: unknown field for Squared"), ("l2", "name")):
        with pytest.raises(ValueError, match=message):
            MemoryRule(loss=bad)


def test_every_registered_loss_has_its_reference_and_its_counterparts():
    """A loss is added in one place per language (docs/EXTENDING.md): registered here, it must be exercised by the
    reference tests above (EXAMPLES), and the C++ loop and the Triton kernels must each compute it or refuse it with
    an error that names an implementation that serves it."""
    assert set(EXAMPLES) == set(LOSSES), "every registered loss needs its examples in EXAMPLES (and they must pass)"
    for name, cls in LOSSES.items():
        assert all(type(example) is cls for example in EXAMPLES[name])
        for example in EXAMPLES[name]:
            e = errors()
            gate = gate_of(example, e)
            for method in (example.value, example.grad, example.grad_derivative):
                method(e, gate)  # implemented (the base class raises NotImplementedError)
            if example.has_gate:
                example.gate_derivative(e, gate)
                example.gate_from_logit(torch.zeros(3))
    module = state_ops.kernels()
    for name in LOSSES:
        for example in EXAMPLES[name]:
            cfg = ScanConfig(4, MemoryRule(loss=example), None, True)
            if module is not None and name in module.LOSSES:
                fused.native_config(cfg)  # the C++ loop takes it
            elif module is not None:
                with pytest.raises(ValueError, match="implementation='autograd'"):
                    fused.native_config(cfg)
    triton_chunk = pytest.importorskip("titans.memory.triton_chunk")
    q, weights = torch.zeros(1, 1, 4, 4), (torch.zeros(1, 1, 4, 4),)
    for name in LOSSES:
        for example in EXAMPLES[name]:
            reason = triton_chunk.unsupported(q, weights, 4, MemoryRule(loss=example))
            if name in triton_chunk.LOSSES:
                assert reason is None or f"the {name} loss" not in reason
            else:
                assert reason is not None and f"the {name} loss" in reason
                assert "implementation='fused' or 'autograd' serves it" in reason


def test_the_triton_kernels_refuse_a_loss_they_lack_by_name(monkeypatch):
    """The kernels compute every registered loss today (tests/memory/test_triton.py holds them to the reference); one
    they lacked would be refused by name, naming the implementations that serve it, and the default would pass it to
    the fused scan."""
    triton_chunk = pytest.importorskip("titans.memory.triton_chunk")
    args, gate = loss_inputs(Huber(gated=True), seq=7)
    if triton_chunk.unsupported(args[0], args[6], 4, paper()) is not None:
        pytest.skip("the Triton kernels do not run here (no GPU and no interpreter)")
    monkeypatch.setattr(triton_chunk, "LOSSES", ("squared", "lp"))
    with pytest.raises(ValueError, match="the huber loss: the Triton kernels compute the squared, lp losses; "
                                         "implementation='fused' or 'autograd' serves it"):
        parallel_memory(*gated(args, gate), rule=paper(loss=Huber(gated=True)), chunk_size=4, implementation="triton")
    assert parallel_memory(*gated(args), rule=paper(loss="huber"),
                           chunk_size=4)[0].shape == args[2].shape  # default: fused


@pytest.mark.parametrize("p, delta", list(itertools.product([1.5, 4.0], [0.05])))
def test_the_biases_differ_from_the_squared_loss_as_they_should(p, delta):
    """What the losses are for, on one token: a write with Huber moves the memory along the clipped error (at most
    2 δ per coordinate of δ_L), ℓp's step is p |e|^{p−1} per coordinate (smaller than the squared loss's for small
    errors at p > 2, larger at p < 2)."""
    args, _ = loss_inputs(Squared(), seq=1, depth=1)
    q, k, v, theta, eta, alpha, weights, momentum = args
    zero = torch.zeros_like(eta)
    step = {}
    for name, loss in (("squared", Squared()), ("huber", Huber(delta=delta)), ("lp", Lp(p=p, eps=1e-12))):
        _, (W,), _ = parallel_memory(q, k, v, Gates(theta, zero, zero), weights, rule=paper(loss=loss), chunk_size=1)
        step[name] = W - weights[0]
    e = k @ weights[0] - v  # the error at W⁰, [b, h, 1, d]
    for name, g in (("squared", 2 * e), ("huber", (2 * e).clamp(-2 * delta, 2 * delta)),
                    ("lp", p * e * e.abs() ** (p - 2))):
        expected = -theta[..., None] * k.transpose(-1, -2) @ g  # one token: S = −θ ∇ℓ, W = W⁰ + S
        assert max_diff([step[name]], [expected]) <= 1e-9, name
