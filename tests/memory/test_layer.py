"""NeuralMemory: streaming with carried state, causality, long streams, options, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titans.memory import MemoryRule, MemoryState, NeuralMemory
from titans.memory.rule import momentum_bound

DT = torch.float64

OPTION_SETS = {
    "default": {},
    "chunk-pooled gates": {"gate_pooling": "chunk"},
    "surprise gate": {"surprise_gate": True},
    "gated deltanet": {"depth": 1, "momentum": False, "residual": False, "gradients": "token", "max_grad_norm": None,
                       "max_state_norm": None, "normalize_chunk": False},
    "summed chunk step": {"normalize_chunk": False},
    "mini-batch deltanet": {"depth": 1, "momentum": False, "residual": False},
    "depth 3 silu": {"depth": 3, "activation": "silu", "expansion": 2},
    "bounded gradient norm": {"max_grad_norm": 0.5},
    "bounded state, active": {"max_state_norm": 0.2},
    "the paper's rule": {"normalize_inputs": False, "max_grad_norm": None, "max_state_norm": None,
                         "max_momentum_step": None, "max_lr": 0.1},
    # the ablations' switches (paper Table 5): each row removes one component
    "linear memory": {"depth": 1, "residual": False},
    "no momentum": {"momentum": False},
    "no forgetting": {"forgetting": False},
    "constant gates": {"gates": "constant", "init_theta": 0.5, "init_eta": 0.9, "init_alpha": 1e-3},
    "hidden layers at 0.3 θ": {"hidden_step": 0.3, "depth": 3, "expansion": 2},
    "channel-wise forgetting": {"forgetting_channels": True},
    "free gates": {"max_momentum_step": None},
    # θ_t ≤ κ (1 − η_t): κ small enough to bind on some tokens of these gates, and through the surprise gate
    "bounded momentum gain": {"max_momentum_step": 0.2},
    "bounded momentum gain, surprise gate": {"max_momentum_step": 0.2, "surprise_gate": True},
    "channel-wise forgetting, chunk-pooled": {"forgetting_channels": True, "gate_pooling": "chunk", "depth": 3,
                                              "expansion": 2},
}
ABLATIONS = ["linear memory", "no momentum", "no forgetting", "constant gates", "channel-wise forgetting",
             "bounded momentum gain"]


# NeuralMemory's arguments beside its rule; every other option of the sets above is a field of the rule
STRUCTURE = ("heads", "depth", "expansion", "chunk_size", "conv_kernel", "checkpoint_chunks", "learned_init",
             "implementation")


def build(dim: int = 16, **options) -> NeuralMemory:
    """NeuralMemory(dim, structure..., rule=MemoryRule(the other options)): the default rule with the options'
    changes."""
    structure = {name: options.pop(name) for name in STRUCTURE if name in options}
    return NeuralMemory(dim, rule=MemoryRule(**options), **structure)


def make_memory(chunk_size=4, **options) -> NeuralMemory:
    torch.manual_seed(0)
    memory = build(16, heads=2, chunk_size=chunk_size, **options).to(DT)
    with torch.no_grad():  # move gates away from their init so every term of the update matters
        if memory.to_gates is not None:
            memory.to_gates.weight.normal_(0, 0.3)
        if memory.surprise_weight is not None:
            memory.surprise_weight.normal_(0, 1.0)
    return memory


def run_in_pieces(memory, x, cuts):
    state, outputs = None, []
    bounds = [0, *cuts, x.shape[1]]
    for a, b in zip(bounds, bounds[1:]):
        y, state = memory(x[:, a:b], state)
        outputs.append(y)
    return torch.cat(outputs, 1), state


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_split_calls_and_token_by_token_equal_one_call(name):
    memory = make_memory(**OPTION_SETS[name])
    x = torch.randn(2, 23, 16, dtype=DT)
    y, state = memory(x)
    y_split, state_split = run_in_pieces(memory, x, [3, 4, 11, 12])
    y_tokens, state_tokens = run_in_pieces(memory, x, list(range(1, 23)))
    for other, other_state in ((y_split, state_split), (y_tokens, state_tokens)):
        assert (other - y).abs().max() <= 1e-12
        for w, w2 in zip(state.weights + state.momentum, other_state.weights + other_state.momentum):
            assert (w - w2).abs().max() <= 1e-12
        assert other_state.seq_pos == 23 and other_state.num_pending == 23 % 4


@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(1, 29), max_size=5, unique=True).map(sorted), chunk_size=st.sampled_from([1, 3, 8]))
def test_any_split_equals_one_call(cuts, chunk_size):
    memory = make_memory(chunk_size=chunk_size)
    x = torch.randn(1, 30, 16, dtype=DT, generator=torch.Generator().manual_seed(len(cuts)))
    y, _ = memory(x)
    y_split, _ = run_in_pieces(memory, x, cuts)
    assert (y_split - y).abs().max() <= 1e-12


def test_state_is_constant_size_token_by_token():
    memory = make_memory(chunk_size=4)
    state = None
    sizes = set()
    for t in range(40):
        _, state = memory(torch.randn(1, 1, 16, dtype=DT), state)
        if t >= 3:
            sizes.add(sum(w.numel() for w in state.weights + state.momentum) + state.conv_cache.numel())
        assert state.num_pending < 4
    assert len(sizes) == 1


@pytest.mark.parametrize("name", ["default", "gated deltanet"])
def test_causality(name):
    memory = make_memory(**OPTION_SETS[name])
    x = torch.randn(2, 20, 16, dtype=DT)
    y, _ = memory(x)
    for j in (0, 6, 13, 19):
        x2 = x.clone()
        x2[:, j] += torch.randn(2, 16, dtype=DT)
        y2, _ = memory(x2)
        assert torch.equal(y2[:, :j], y[:, :j])
        assert (y2[:, j:] - y[:, j:]).abs().max() > 1e-8


def test_chunk_pooling_keeps_gates_constant_within_a_chunk():
    memory = make_memory(chunk_size=4, gate_pooling="chunk")
    logits = torch.randn(1, 2, 10, 3, dtype=DT)
    theta, eta, alpha, _ = memory._gate_values(logits)
    for gate in (theta, eta, alpha):
        assert torch.equal(gate[..., 0:4], gate[..., :1].expand(-1, -1, 4))
        assert torch.equal(gate[..., 8:10], gate[..., 8:9].expand(-1, -1, 2))


def test_retrieve_reads_without_writing():
    memory = make_memory(chunk_size=4)
    x = torch.randn(2, 10, 16, dtype=DT)
    _, state = memory(x)
    before = [w.clone() for w in state.weights]
    queries = torch.randn(2, 5, 16, dtype=DT)
    h, cache = memory.retrieve(queries, state)
    assert h.shape == (2, 5, 16) and cache.shape == (2, 3, 16)
    assert all(torch.equal(a, b) for a, b in zip(before, state.weights))
    # retrieving in two pieces with the query cache equals one call
    h1, c1 = memory.retrieve(queries[:, :2], state)
    h2, _ = memory.retrieve(queries[:, 2:], state, c1)
    assert (torch.cat([h1, h2], 1) - h).abs().max() <= 1e-12
    # the memory that was written differs from the initial one, and so do the reads
    h0, _ = memory.retrieve(queries, None)
    assert (h0 - h).abs().max() > 1e-6


def test_outer_gradients_reach_every_parameter():
    memory = make_memory(chunk_size=4, surprise_gate=True)
    y, _ = memory(torch.randn(2, 13, 16, dtype=DT))
    y.pow(2).sum().backward()
    for name, p in memory.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_checkpointing_matches_plain_training_gradients():
    x = torch.randn(2, 64, 16, dtype=DT)
    grads = []
    for checkpoint_chunks in (None, 2):
        memory = make_memory(chunk_size=4, checkpoint_chunks=checkpoint_chunks)
        memory(x)[0].pow(2).sum().backward()
        grads.append([p.grad for p in memory.parameters()])
    assert max((a - b).abs().max().item() for a, b in zip(*grads)) <= 1e-12


def test_long_stream_stays_finite_float32():
    """200k random tokens through one state, float32, with the step at its bound (θ ≈ max_lr) and
    almost no forgetting: the default rule keeps the memory finite and inside its ball."""
    torch.manual_seed(0)
    memory = build(64, heads=2, chunk_size=16, depth=2, expansion=4)
    with torch.no_grad():
        memory.to_gates.bias.view(3, 2)[0].fill_(4.0)  # θ ≈ 0.98 max_lr
        memory.to_gates.bias.view(3, 2)[1].fill_(0.0)  # η ≈ 0.5
        memory.to_gates.bias.view(3, 2)[2].fill_(-8.0)  # α ≈ 3e-4
    state = None
    with torch.no_grad():
        for _ in range(20):
            y, state = memory(torch.randn(1, 10_000, 64), state)
            assert torch.isfinite(y).all()
    assert state.seq_pos == 200_000
    assert all(torch.isfinite(w).all() for w in state.weights + state.momentum)
    assert all(w.dtype == torch.float32 for w in state.weights)
    assert all(torch.linalg.vector_norm(w, dim=(-2, -1)).max() <= 10.0 * w.shape[-1] ** 0.5 * (1 + 1e-5)
               for w in state.weights + state.momentum)


def test_bf16_model_keeps_float32_state():
    memory = build(16, heads=2, chunk_size=4).to(torch.bfloat16)
    y, state = memory(torch.randn(1, 9, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert isinstance(state, MemoryState) and all(w.dtype == torch.float32 for w in state.weights + state.momentum)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dim": 10, "heads": 3}, "dim"),
        ({"depth": 0}, "depth"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"max_lr": 0.0}, "max_lr"),
        ({"activation": "tanh"}, "activation"),
        ({"gate_pooling": "mean"}, "gate_pooling"),
        ({"init_alpha": 0.0}, "init_alpha"),
        ({"init_alpha": 1.0}, "init_alpha"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm"),
        ({"max_state_norm": 0.0}, "max_state_norm"),
        ({"max_state_norm": float("nan")}, "max_state_norm"),
        ({"max_momentum_step": 0.0}, "max_momentum_step"),
        ({"max_momentum_step": float("inf")}, "max_momentum_step"),
        ({"init_eta": 1.0}, "init_eta"),
        ({"init_theta": 1.0}, "init_theta"),
        ({"max_lr": 0.1, "init_theta": 0.2}, "init_theta"),
    ],
)
def test_bad_construction_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        build(**{"dim": 16, **kwargs})


def test_init_values_are_the_gates_at_initialisation():
    memory = build(16, heads=2, max_lr=0.5, init_theta=0.05, init_eta=0.3, init_alpha=3e-4)
    with torch.no_grad():
        memory.to_gates.weight.zero_()
        logits = memory.to_gates(torch.randn(1, 5, 16)).unflatten(-1, (3, 2)).permute(0, 3, 1, 2)  # [B, H, T, 3]
        theta, eta, alpha, _ = memory._gate_values(logits)
    for gate, value in ((theta, 0.05), (eta, 0.3), (alpha, 3e-4)):
        torch.testing.assert_close(gate, torch.full_like(gate, value))
    assert build(16, max_lr=0.5).to_gates.bias[0].item() == pytest.approx(math.log(0.2 / 0.8))  # 0.2 θ_max


@pytest.mark.parametrize("surprise_gate", [False, True])
def test_the_layer_leaves_the_momentum_gain_bound_to_the_core(surprise_gate, monkeypatch):
    """The layer hands the functional core its gates as they are, and the core bounds θ by κ (once, as every
    implementation and the reference do): the layer under κ = 0.2 gives what the core gives under the paper's free
    gates for θ bounded by hand, min(θ_t, κ (1 − η_t)), which binds on some tokens here."""
    from titans.memory import layer

    memory = make_memory(surprise_gate=surprise_gate, max_momentum_step=0.2)
    x = torch.randn(2, 11, 16, dtype=DT, generator=torch.Generator().manual_seed(5)) * 3
    y, _ = memory(x)
    calls, original = [], layer.parallel_memory

    def free_gates_bounded_by_hand(q, k, v, gates, *args, rule, **kwargs):
        theta, eta = gates.theta, gates.eta
        if callable(theta):
            bound, gate = 0.2 * (1 - eta), theta
            theta = lambda s, a, b: torch.minimum(gate(s, a, b), bound[:, :, a:b])  # noqa: E731
        else:
            calls.append(bool((theta > 0.2 * (1 - eta)).any()))
            theta = torch.minimum(theta, 0.2 * (1 - eta))
        return original(q, k, v, gates._replace(theta=theta), *args, rule=rule.replace(max_momentum_step=None),
                        **kwargs)

    monkeypatch.setattr(layer, "parallel_memory", free_gates_bounded_by_hand)
    y_by_hand, _ = memory(x)
    assert torch.equal(y, y_by_hand)
    assert surprise_gate or any(calls)  # the bound had work to do


def test_the_momentum_gain_is_bounded_at_one_by_default_and_only_where_the_gates_are_learned():
    """κ = 1 is the default of the layer and the config alike (DESIGN.md §1); constant gates are the numbers given,
    θ = 0.5 with η = 0.9 included (a gain of 5), and the bound does not touch them."""
    from titans.models import TitansConfig

    assert NeuralMemory(16).rule.max_momentum_step == TitansConfig().memory.max_momentum_step == 1.0
    options = {"gates": "constant", "init_theta": 0.5, "init_eta": 0.9}
    constant, bounded = make_memory(**options, max_momentum_step=None), make_memory(**options, max_momentum_step=0.05)
    logits = bounded._gate_logits(torch.randn(1, 7, 16, dtype=DT)).unflatten(-1, (3, 2)).permute(0, 3, 1, 2)
    theta, eta, _, _ = bounded._gate_values(logits)
    assert momentum_bound(bounded.rule, eta) is None
    torch.testing.assert_close(theta, torch.full_like(theta, 0.5))
    torch.testing.assert_close(eta, torch.full_like(eta, 0.9))
    x = torch.randn(2, 11, 16, dtype=DT)
    assert torch.equal(bounded(x)[0], constant(x)[0])


def test_the_bound_counts_the_learned_thetas_it_lowers_in_training_only():
    """`momentum_bound_record`: (θ_t that κ lowered, θ_t it bounded) over training forwards, the first counted
    against the free gates themselves; evaluation adds nothing, and κ off or constant gates bound nothing."""
    bounded, free = make_memory(max_momentum_step=0.2), make_memory(max_momentum_step=None)
    x = torch.randn(2, 11, 16, dtype=DT, generator=torch.Generator().manual_seed(3)) * 3
    logits = free._gate_logits(x).unflatten(-1, (3, 2)).permute(0, 3, 1, 2)  # [B, H, T, 3]
    theta, eta, _, _ = free._gate_values(logits)
    expected = int((theta > 0.2 * (1 - eta)).sum())
    assert 0 < expected < theta.numel()
    bounded(x)
    assert bounded.momentum_bound_record() == (expected, theta.numel())
    bounded.eval()
    bounded(x)
    assert bounded.momentum_bound_record() == (expected, theta.numel())
    free(x)
    assert free.momentum_bound_record() == (0, 0)
    constant = make_memory(gates="constant", init_theta=0.5, init_eta=0.9, max_momentum_step=0.05)
    constant(x)
    assert constant.momentum_bound_record() == (0, 0)


def test_bad_input_shape():
    with pytest.raises(ValueError, match="x must be"):
        NeuralMemory(16)(torch.randn(2, 5, 8))


@pytest.mark.parametrize("name", ["default", "surprise gate"])
def test_memory_receives_unit_queries_and_keys_and_bounded_rates(name, monkeypatch):
    """What NeuralMemory hands the update rule: l2-normalised q and k, θ in [0, max_lr] even for huge gate
    logits (also through the surprise gate), η and α in [0, 1]."""
    from titans.memory import layer

    calls = []
    original = layer.parallel_memory
    monkeypatch.setattr(layer, "parallel_memory", lambda *a, **kw: calls.append(a) or original(*a, **kw))
    memory = make_memory(max_lr=0.05, **OPTION_SETS[name])
    with torch.no_grad():
        memory.to_gates.weight.normal_(0, 50.0)  # logits far into saturation, both signs
    memory(torch.randn(2, 10, 16, dtype=DT))
    assert calls
    for q, k, v, (theta, eta, alpha, _), *_ in calls:
        for t in (q, k):
            assert torch.allclose(t.norm(dim=-1), torch.ones((), dtype=DT), atol=1e-12)
        if callable(theta):
            theta = theta(torch.full(q.shape[:3], 1e6, dtype=DT), 0, q.shape[2])
        assert theta.min() >= 0 and theta.max() <= 0.05 and theta.max() > 0.04  # saturated tokens reach the bound
        for gate in (eta, alpha):
            assert gate.min() >= 0 and gate.max() <= 1


def test_token_gradients_do_not_depend_on_the_chunk_size():
    """gradients="token" is the exact delta rule: the chunk size changes the cost, never the outputs; chunk-wise
    gradients (Titans' mini-batch form) do change them."""
    x = torch.randn(2, 19, 16, dtype=DT, generator=torch.Generator().manual_seed(3))
    outputs = {}
    for gradients in ("token", "chunk"):
        for chunk_size in (1, 4, 16):
            memory = make_memory(chunk_size=chunk_size, **{**OPTION_SETS["gated deltanet"], "gradients": gradients})
            with torch.no_grad():
                memory.to_gates.bias.view(3, 2)[0].fill_(2.0)  # large steps: the chunk-start error is visible
            outputs[gradients, chunk_size] = memory(x)[0]
    for chunk_size in (4, 16):
        assert (outputs["token", chunk_size] - outputs["token", 1]).abs().max() <= 1e-12
        assert (outputs["chunk", chunk_size] - outputs["chunk", 1]).abs().max() > 1e-4
    assert (outputs["token", 1] - outputs["chunk", 1]).abs().max() <= 1e-12  # chunks of one token: the same rule


@pytest.mark.parametrize("kwargs", [dict(depth=2), dict(momentum=True), dict(surprise_gate=True),
                                    dict(max_grad_norm=1.0), dict(max_state_norm=1.0), dict(normalize_chunk=True),
                                    dict(gradients="exact")])
def test_token_gradients_need_the_delta_rule_configuration(kwargs):
    options = {**OPTION_SETS["gated deltanet"], **kwargs}
    with pytest.raises(ValueError, match="gradients"):
        build(16, heads=2, **options)


def test_a_state_of_another_dtype_is_refused():
    memory = make_memory()
    _, state = memory(torch.randn(1, 6, 16, dtype=DT))
    with pytest.raises(ValueError, match="float64 weights but this memory keeps its state in torch.float32"):
        make_memory().float()(torch.randn(1, 3, 16), state)


def test_a_state_this_memory_could_not_have_returned_is_refused():
    """Another batch, depth, width, chunk size or kind of state: a ValueError naming the field, not a failure deep
    inside a cat or matmul (or, where shapes happen to fit, a silent run)."""
    memory = make_memory()
    _, state = memory(torch.randn(2, 6, 16, dtype=DT))  # 2 tokens pending in a chunk of 4
    x = torch.randn(2, 2, 16, dtype=DT)
    cases = [  # (layer, input, state, what the error says)
        (memory, torch.randn(3, 2, 16, dtype=DT), state,
         r"state.weights\[0\] has shape \[2, 2, 8, 32\], expected \[3, 2, 8, 32\]"),
        (make_memory(depth=1), x, state, "state holds 2 weight and 2 momentum layers, this memory has 1"),
        (make_memory(expansion=2), x, state, r"state.weights\[0\] has shape .*expected \[2, 2, 8, 16\]"),
        (make_memory(chunk_size=2), x, state, "2 pending tokens, but a chunk of 2 completes at 2"),
        (make_memory(conv_kernel=2), x, state, r"state.conv_cache has shape \[2, 3, 48\], expected \[2, 1, 48\]"),
        (memory, x, state.weights, "continues from a state of type MemoryState, got tuple"),
    ]
    for layer, x, wrong_state, message in cases:
        with pytest.raises(ValueError, match=message):
            layer(x, wrong_state)
    with pytest.raises(ValueError, match=r"state.weights\[0\] has shape"):
        memory.retrieve(torch.randn(3, 2, 16, dtype=DT), state)
    with pytest.raises(ValueError, match=r"state.query_cache has shape \[2, 3, 16\], expected \[3, 3, 16\]"):
        memory.retrieve(torch.randn(3, 2, 16, dtype=DT), None, memory.retrieve(torch.randn(2, 2, 16, dtype=DT))[1])


@pytest.mark.parametrize("name", ABLATIONS)
def test_ablation_switches_equal_the_token_by_token_rule(name, monkeypatch):
    """Each switch is the token-by-token rule (eqs. 10-14) with its component removed: the layer run through
    `sequential_memory` in place of the chunk-parallel path gives the same outputs and states, and the gates the
    rule receives are the switch's (η = 0, α = 0, or θ, η, α the constants for every token)."""
    from titans.memory import layer
    from titans.memory.reference import sequential_memory

    memory = make_memory(**OPTION_SETS[name])
    x = torch.randn(2, 23, 16, dtype=DT, generator=torch.Generator().manual_seed(1))
    y, state = memory(x)
    calls = []
    monkeypatch.setattr(layer, "parallel_memory", lambda *a, **kw: calls.append(a) or sequential_memory(
        *a, **{key: value for key, value in kw.items() if key not in ("checkpoint_chunks", "implementation")}))
    y_ref, state_ref = memory(x)
    assert (y - y_ref).abs().max() <= 1e-12
    for w, w_ref in zip(state.weights + state.momentum, state_ref.weights + state_ref.momentum):
        assert (w - w_ref).abs().max() <= 1e-12
    for _, _, _, (theta, eta, alpha, _), weights, *_ in calls:
        if name == "no momentum":
            assert (eta == 0).all() and (alpha > 0).all()
        if name == "no forgetting":
            assert (alpha == 0).all() and (eta > 0).all()
        if name == "constant gates":
            for gate, value in ((theta, 0.5), (eta, 0.9), (alpha, 1e-3)):
                torch.testing.assert_close(gate, torch.full_like(gate, value), rtol=1e-12, atol=0)
        if name == "bounded momentum gain":  # the free θ_t, which the rule (the reference's here) bounds on some tokens
            assert (theta > 0.2 * (1 - eta)).any()
        if name == "channel-wise forgetting":  # one α per output column of each layer, each its own
            assert [a.shape[-1] for a in alpha] == [w.shape[-1] for w in weights] == [32, 8]
            assert all(a.std(-1).min() > 0 for a in alpha)
        if name == "linear memory":  # M(k) = k W: one layer, and no residual (W = 0 reads 0)
            assert len(weights) == 1
            assert layer.memory_apply(x.new_ones(1, 1, 1, 8), (torch.zeros(1, 1, 8, 8, dtype=DT),),
                                      memory.rule).abs().max() == 0


def test_constant_gates_are_not_parameters():
    data, constant = build(16, heads=2), build(16, heads=2, gates="constant")
    names = {name for name, _ in constant.named_parameters()}
    assert not any(name.startswith("to_gates") for name in names)
    assert sum(p.numel() for p in data.parameters()) - sum(p.numel() for p in constant.parameters()) == 16 * 6 + 6
    assert "constant_gate_logits" not in constant.state_dict()  # derived from the config, not saved
    y, _ = constant.double()(torch.randn(1, 8, 16, dtype=DT))
    y.sum().backward()  # the outer loop trains everything else
    assert all(p.grad is not None for p in constant.parameters())


def test_channel_wise_forgetting_gates():
    """α per output column of every layer: the gate projection grows by one output per column, every α starts at
    init_alpha, and the exact delta rule (one α per token) refuses it."""
    scalar, channels = build(16, heads=2), build(16, heads=2, forgetting_channels=True)
    assert channels.to_gates.out_features == 2 * (2 + 32 + 8) and scalar.to_gates.out_features == 2 * 3
    _, _, alpha, _ = channels._gate_values(channels.to_gates.bias.view(-1, 2).T[None, :, None].double())
    assert [tuple(a.shape) for a in alpha] == [(1, 2, 1, 32), (1, 2, 1, 8)]
    assert all(torch.allclose(a, torch.full_like(a, 1e-5)) for a in alpha)
    with pytest.raises(ValueError, match="forgetting_channels=False"):
        build(16, depth=1, momentum=False, residual=False, gradients="token", max_grad_norm=None,
                     max_state_norm=None, normalize_chunk=False, forgetting_channels=True)


def test_constant_gates_refuse_the_surprise_gate():
    with pytest.raises(ValueError, match="constant"):
        build(16, gates="constant", surprise_gate=True)
    with pytest.raises(ValueError, match="gates"):
        build(16, gates="learned")
