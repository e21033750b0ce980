"""The fused scan's chunk loop in C++ (`kernels/scan.cpp`) against the same loop in Python (`fused.py`).

The C++ loop is `_run_chunks` / `_backward_chunks` line for line, run on one slice of batch·heads rows per thread.
In float64 both take the ATen products, so they must agree to rounding (≤ 1e-12), values and every gradient,
for every option and for slicings with one, two and three threads; in float32 the C++ loop takes the state kernels
as Python does. The rest of the suite (`test_functional.py`, `test_fused.py`) runs the C++ loop wherever it is
built, against the token-by-token reference.
"""

import itertools

import pytest
import torch

from titans.memory import fused, parallel_memory, state_ops

from .test_functional import flat, gated, make_inputs, paper
from .test_fused import outputs_and_grads

pytestmark = pytest.mark.skipif(state_ops.kernels() is None,
                                reason="the compiled module is unavailable here (no C++ compiler, or not x86-64 Linux)")


@pytest.fixture
def threads():
    """Sets torch's thread count for one test (the slicing follows it) and restores it after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def both_loops(monkeypatch, args, **kwargs):
    """Outputs and gradients with the chunk loop in C++, then in Python; fails if the C++ loop was not taken."""
    calls = []
    module = state_ops.kernels()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(module, name)

    monkeypatch.setattr(fused, "_native", lambda x: Spy())
    native = outputs_and_grads(args, "fused", **kwargs)
    assert {"run_chunks", "backward_chunks"} <= set(calls)
    monkeypatch.setattr(fused, "NATIVE", False)
    monkeypatch.setattr(fused, "_native", lambda x: None)
    python = outputs_and_grads(args, "fused", **kwargs)
    return native, python


def assert_close(native, python, tol):
    for a, b in zip(native[0] + list(native[1]), python[0] + list(python[1])):
        assert a.shape == b.shape
        scale = b.abs().max().item() or 1.0
        assert (a - b).abs().max().item() <= tol * scale


@pytest.mark.parametrize(
    "depth, activation, residual, max_grad_norm",
    list(itertools.product([1, 2, 3], ["gelu", "silu"], [True, False], [None, 0.5])),
)
def test_native_loop_equals_python_loop_float64(monkeypatch, threads, depth, activation, residual, max_grad_norm):
    threads(2)
    args = make_inputs(batch=2, heads=2, seq=21, depth=depth, requires_grad=True)  # 4 rows: two slices of two
    rule = paper(activation=activation, residual=residual, max_grad_norm=max_grad_norm,
                 max_state_norm=None if max_grad_norm is None else 0.7)
    native, python = both_loops(monkeypatch, args, rule=rule, chunk_size=4)
    assert_close(native, python, 1e-12)


@pytest.mark.parametrize("depth, bounded, group", [(1, False, None), (2, True, None), (3, True, 2)])
def test_native_loop_with_the_normalized_chunk_step(monkeypatch, threads, depth, bounded, group):
    threads(2)
    args = make_inputs(batch=2, heads=2, seq=21, depth=depth, requires_grad=True)
    rule = dict(max_grad_norm=0.5, max_state_norm=0.7) if bounded else {}
    native, python = both_loops(monkeypatch, args, rule=paper(normalize_chunk=True, **rule), chunk_size=4,
                                checkpoint_chunks=group)
    assert_close(native, python, 1e-12)


@pytest.mark.parametrize("depth, hidden_step, group, bounded", [(2, 0.1, None, False), (3, 0.3, 2, True),
                                                               (2, 0.0, None, True)])
def test_native_loop_with_the_hidden_layer_step(monkeypatch, threads, depth, hidden_step, group, bounded):
    """ρ θ on the hidden layers: with recomputation groups, the gradient bound, the bounded state and ρ = 0."""
    threads(2)
    args = make_inputs(batch=2, heads=2, seq=21, depth=depth, requires_grad=True)
    rule = dict(max_grad_norm=0.5, max_state_norm=0.7, normalize_chunk=True) if bounded else {}
    native, python = both_loops(monkeypatch, args, rule=paper(hidden_step=hidden_step, **rule), chunk_size=4,
                                checkpoint_chunks=group)
    assert_close(native, python, 1e-12)


@pytest.mark.parametrize("rows, num_threads", [(1, 2), (3, 2), (4, 3), (5, 1)])
@pytest.mark.parametrize("seq, chunk_size, group", [(21, 4, None), (21, 4, 2), (16, 16, None), (3, 5, None)])
def test_slicings_groups_and_ragged_tails(monkeypatch, threads, rows, num_threads, seq, chunk_size, group):
    """One slice (fewer rows than threads, or one thread), uneven slices, recomputation groups, ragged tails and a
    sequence shorter than a chunk."""
    threads(num_threads)
    args = make_inputs(batch=rows, heads=1, seq=seq, requires_grad=True)
    native, python = both_loops(monkeypatch, args, rule=paper(max_state_norm=0.7), chunk_size=chunk_size,
                                checkpoint_chunks=group)
    assert_close(native, python, 1e-12)


def test_native_loop_with_kernels_float32(monkeypatch, threads):
    """Widths that the state kernels serve (multiples of 16, 16-row chunks), as in training."""
    threads(2)
    args = make_inputs(batch=2, heads=2, seq=40, dim=16, hidden=64, requires_grad=False)
    args = [tuple(t.float().requires_grad_() for t in a) if isinstance(a, tuple) else a.float().requires_grad_()
            for a in args]
    native, python = both_loops(monkeypatch, args, rule=paper(max_grad_norm=1.0), chunk_size=16)
    assert_close(native, python, 2e-5)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_native_loop_without_recording(threads, mode):
    """Without autograd the slices' threads must see the caller's mode: inference tensors may only be written in
    inference mode."""
    threads(2)
    args = make_inputs(batch=2, heads=2, seq=21)
    expected = parallel_memory(*gated(args), rule=paper(), chunk_size=4, implementation="autograd")
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        got = parallel_memory(*gated(args), rule=paper(), chunk_size=4)
    for a, b in zip(flat(list(got)), flat(list(expected))):
        assert (a - b).abs().max().item() <= 1e-12


def test_one_rule_decides_which_products_the_kernels_serve():
    """`state_ops.kernels_for` asks the compiled module's `kernel_serves`, the rule the C++ loop uses."""
    module = state_ops.kernels()
    W, rows = torch.randn(2, 32, 64), torch.randn(2, module.MIN_ROWS, 32)
    served = module.STATE_KERNELS
    assert module.kernel_serves(W, module.MIN_ROWS) == served
    assert (state_ops.kernels_for(W, rows) is not None) == served
    for W_, n in [(W, module.MIN_ROWS - 1), (W.double(), 16), (torch.randn(2, 32, 24), 16),
                  (torch.randn(2, 64, 32).transpose(1, 2), 16), (torch.randn(32, 64), 16)]:
        assert not module.kernel_serves(W_, n)
        assert state_ops.kernels_for(W_, torch.randn(2, n, 32)) is None
