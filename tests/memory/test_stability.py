"""The memory with its default rule stays finite and bounded whatever the input (DESIGN.md §1, "Stable by default").

Property tests over input scale, depth, activation, momentum, chunk size, gates and where a stream is cut: outputs,
states and gradients finite, and at every chunk end each W_i, S_i inside its ball ‖·‖_F ≤ max_state_norm · √d_out.
The gates either as initialised or at their worst (θ = θ_max, η = 1, α = 0 on every token), where the paper's
unbounded rule runs away (shown beside). Long streams (1M tokens) are `titans bench stability`'s job.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titans import TitansConfig
from titans.bench.stability import RULES, WORST_GATE_LOGITS
from titans.memory import MemoryRule, NeuralMemory

DIM, HEADS = 16, 2


def memory_for(depth, activation, momentum, chunk_size, worst, rule=RULES["ours"]):
    memory = NeuralMemory(DIM, heads=HEADS, depth=depth, chunk_size=chunk_size,
                          rule=rule.replace(activation=activation, momentum=momentum))
    if worst:
        with torch.no_grad():
            for row, value in zip(memory.to_gates.bias.view(3, HEADS), WORST_GATE_LOGITS):
                row.fill_(value)
    return memory


def assert_bounded(memory, state):
    for t in (*state.weights, *state.momentum):
        assert torch.isfinite(t).all()
        norm = torch.linalg.vector_norm(t, dim=(-2, -1))
        assert (norm <= memory.rule.max_state_norm * math.sqrt(t.shape[-1]) * (1 + 1e-5)).all(), norm.max()


scales = st.integers(-3, 3).flatmap(lambda e: st.floats(0.5, 2.0).map(lambda m: m * 10.0**e))
cases = dict(scale=scales, depth=st.integers(1, 4), activation=st.sampled_from(["gelu", "silu"]),
             momentum=st.booleans(), chunk_size=st.sampled_from([1, 3, 16, 64]), worst=st.booleans())


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(1, 199), max_size=4, unique=True).map(sorted), **cases)
def test_streams_stay_finite_and_bounded(cuts, scale, depth, activation, momentum, chunk_size, worst):
    torch.manual_seed(0)
    memory = memory_for(depth, activation, momentum, chunk_size, worst)
    x = torch.randn(1, 200, DIM) * scale
    state = None
    with torch.no_grad():
        for a, b in zip([0, *cuts], [*cuts, 200]):
            y, state = memory(x[:, a:b], state)
            assert torch.isfinite(y).all()
            assert_bounded(memory, state)


@settings(max_examples=20, deadline=None)
@given(**cases)
def test_training_gradients_stay_finite(scale, depth, activation, momentum, chunk_size, worst):
    torch.manual_seed(0)
    memory = memory_for(depth, activation, momentum, chunk_size, worst)
    y, state = memory(torch.randn(2, 150, DIM) * scale)
    (y.pow(2).mean() + sum(w.pow(2).mean() for w in state.weights)).backward()
    assert torch.isfinite(y).all()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in memory.parameters())
    assert_bounded(memory, state)


@settings(max_examples=10, deadline=None)
@given(scale=scales, depth=st.integers(1, 4), chunk_size=st.sampled_from([1, 16]))
def test_bf16_autocast_stays_finite_and_bounded(scale, depth, chunk_size):
    torch.manual_seed(0)
    memory = memory_for(depth, "gelu", True, chunk_size, worst=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = memory(torch.randn(1, 150, DIM) * scale)
        y.float().pow(2).mean().backward()
    assert torch.isfinite(y).all() and all(torch.isfinite(p.grad).all() for p in memory.parameters())
    assert all(w.dtype == torch.float32 for w in state.weights)
    assert_bounded(memory, state)


@pytest.mark.parametrize("scale", [10.0, 1000.0])
def test_the_paper_rule_runs_away_where_the_default_does_not(scale):
    """What the default rule is for: the same stream with the paper's rule (no bound, values and gates as x comes)
    goes non-finite, with the worst gates or merely large inputs (the issue that started this: NaN within 100 tokens
    at scale 10)."""
    torch.manual_seed(0)
    x = torch.randn(1, 512, DIM) * scale
    with torch.no_grad():
        paper, _ = memory_for(2, "gelu", True, 16, worst=True, rule=RULES["paper"])(x)
        ours, state = memory_for(2, "gelu", True, 16, worst=True)(x)
    assert not torch.isfinite(paper).all()
    assert torch.isfinite(ours).all()


def test_the_default_rule_is_on_by_default():
    for rule in (NeuralMemory(DIM, heads=HEADS).rule, TitansConfig(variant="lmm").memory.rule):
        assert rule.normalize_inputs and rule.max_grad_norm is not None and rule.max_state_norm is not None
        assert rule.normalize_chunk and rule.max_momentum_step is not None and rule.loss.name == "squared"
    paper = MemoryRule.paper()
    assert not paper.normalize_inputs and not paper.normalize_chunk
    assert paper.max_grad_norm is None and paper.max_state_norm is None and paper.max_momentum_step is None
