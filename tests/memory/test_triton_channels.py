"""The Triton kernels with α per output column of every layer (`triton_chunk`'s channel path: each column's decays
formed in the kernels from its log-keeps) against the token-by-token reference, under the interpreter where there is
no GPU (as test_triton.py). A file of its own so that the suite's workers run it beside test_triton.py."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it first, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -c constraints.txt -e '.[gpu]')")

from .test_functional import channel_alpha, max_diff, with_grad  # noqa: E402
from .test_triton import BOUNDS, DEVICE, inputs, on_device, outputs_and_grads  # noqa: E402

# α per output column of every layer (the kernels form each column's decays from its log-keeps): the shape classes
# where the per-column algebra differs (two layers and three, a ragged chunk, several column tiles, chunks of one
# token) with every switch that touches it (the bounds, the normalised chunk step, the hidden step, recomputation
# groups).
CHANNEL_CASES = {
    "deep, the default rule, recomputation groups": (2, 11, 4, (4, 8),
                                                     dict(normalize_chunk=True, checkpoint_chunks=2, **BOUNDS)),
    "depth 3, hidden step, silu, chunks of one token": (3, 3, 1, (4, 8), dict(activation="silu", hidden_step=0.3)),
    "several column tiles, chunk 8": (2, 12, 8, (4, 20), dict(normalize_chunk=True, **BOUNDS)),
}


@pytest.mark.parametrize("case", list(CHANNEL_CASES))
def test_channel_wise_forgetting_matches_the_reference_in_float64(case):
    """α per channel through the kernels: values, end state and the gradients of every input (every layer's α
    included) as the token-by-token reference computes them (≤ 1e-10), the last chunk ragged."""
    depth, seq, chunk, (dim, hidden), kwargs = CHANNEL_CASES[case]
    kwargs = dict(kwargs)
    args = with_grad(on_device(channel_alpha(inputs(seq, depth, dim, hidden))))
    got = outputs_and_grads(args, "triton", chunk_size=chunk, **kwargs)
    kwargs.pop("checkpoint_chunks", None)
    ref = outputs_and_grads(args, None, chunk_size=chunk, **kwargs)
    assert max_diff(got[0], ref[0]) <= 1e-10
    assert max_diff(got[1], ref[1]) <= 1e-10


def test_channel_wise_forgetting_with_saturated_gates():
    """Columns that forget everything (α = 1: log-keep at LOG_FLOOR) next to ones that keep almost all: the kernels'
    range sums are summed on their own, never differences of prefix sums near −1e4, so float32 still gives the
    autograd path's numbers (outputs within 1e-5, gradients within 1e-4; a saturated gate's own gradient is 0 in
    both, decays.py)."""
    args = on_device(channel_alpha(inputs(11, 2)), torch.float32)
    alpha = list(args[5])
    alpha[0] = alpha[0].clone()
    alpha[0][..., 3, 1] = 1.0
    alpha[0][..., 5:7, 2] = 1.0
    alpha[1] = alpha[1].clone()
    alpha[1][..., 4, :3] = 1.0
    args[5] = tuple(alpha)
    args = with_grad(args)
    got = outputs_and_grads(args, "triton", chunk_size=4, **BOUNDS)
    plain = outputs_and_grads(args, "autograd", chunk_size=4, **BOUNDS)
    assert max_diff(got[0], plain[0]) <= 1e-5
    assert max_diff(got[1], plain[1]) <= 1e-4


def test_the_layer_with_channel_wise_forgetting_runs_the_kernels():
    """NeuralMemory(forgetting_channels) asked for the kernels gets them (one α per output column of each layer, split
    from its gate projection), with the autograd path's numbers in float32 (within 1e-5; the parameters' gradients
    relative to their size)."""
    from titans.memory import MemoryRule, NeuralMemory

    torch.manual_seed(0)
    rule = MemoryRule(forgetting_channels=True)
    layers = [NeuralMemory(8, heads=2, depth=2, expansion=2, chunk_size=4, rule=rule, implementation=name).to(DEVICE)
              for name in ("autograd", "triton")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(1, 6, 8, device=DEVICE)
    outs = [layer(x)[0] for layer in layers]
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5
    grads = [torch.autograd.grad(out.square().sum(), list(layer.parameters())) for out, layer in zip(outs, layers)]
    assert max(((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item() for a, b in zip(*grads)) <= 1e-5
