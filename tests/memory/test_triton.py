"""The Triton kernels (`triton_chunk.py`) against the token-by-token reference and the autograd dual form.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, numpy on CPU tensors, set here before
`titans.memory.triton_chunk` is imported), so they are held to the reference on every machine where triton is
installed; with a GPU they run compiled, on CUDA tensors. Shapes are small (widths 4–40, 2–3 chunks with a ragged
last one, tiles of 16 where a case needs several tiles per product): the interpreter runs every program of the grid
one after the other in numpy. The interpreter runs any Python, so the kernels are also compiled for sm_90 and sm_80
GPUs here: test_triton_compile.py.
"""

import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it first, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -c constraints.txt -e '.[gpu]')")


from titans.memory import MemoryRule, parallel_memory, sequential_memory, triton_chunk  # noqa: E402
from titans.memory.parallel import serving_implementation  # noqa: E402

from .test_functional import channel_alpha, flat, gated, make_inputs, max_diff, paper, with_grad  # noqa: E402
from .test_losses import CASES as LOSS_CASES  # noqa: E402
from .test_losses import IDS as LOSS_IDS  # noqa: E402

DEVICE = "cpu" if triton_chunk.INTERPRET else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("triton_chunk was imported without TRITON_INTERPRET=1 and there is no GPU", allow_module_level=True)

def inputs(seq, depth, dim=4, hidden=8, heads=2):
    """One batch row of `heads` heads (the kernels' grid: one program per head)."""
    return make_inputs(batch=1, heads=heads, seq=seq, depth=depth, dim=dim, hidden=hidden)


def on_device(args, dtype=None):
    def move(t):
        return t.detach().to(DEVICE, dtype or t.dtype)
    return [tuple(move(t) for t in a) if isinstance(a, tuple) else move(a) for a in args]


def outputs_and_grads(args, implementation, used=("y", "W", "S"), gate=None, **kwargs):
    """The outputs, and the gradients of every input (the loss's `gate` too, where given) of a random linear loss of
    the outputs named in `used`; implementation None: the token-by-token reference. The keyword arguments that are
    fields of the rule change the paper's rule (`MemoryRule.paper`); the others go to the call."""
    kwargs["rule"] = paper(**{name: kwargs.pop(name) for name in list(kwargs) if name in MemoryRule.model_fields})
    if implementation is None:
        y, W, S = sequential_memory(*gated(args, gate), **kwargs)
    else:
        y, W, S = parallel_memory(*gated(args, gate), implementation=implementation, **kwargs)
    outs = {"y": [y], "W": list(W), "S": list(S)}
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype)).sum()
               for name in used for o in outs[name])
    inputs = flat(args) + ([gate] if gate is not None else [])
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [y, *W, *S], [torch.zeros_like(x) if d is None else d for d, x in zip(grads, inputs)]


def with_value_width(args, width):
    """Inputs without the residual's constraint: values (and the last layer's output) `width` wide."""
    q, k, v, theta, eta, alpha, weights, momentum = args
    g = torch.Generator().manual_seed(5)
    v = torch.randn(*v.shape[:3], width, generator=g, dtype=v.dtype)
    last = torch.randn(*weights[-1].shape[:3], width, generator=g, dtype=v.dtype) / weights[-1].shape[2] ** 0.5
    return [q, k, v, theta, eta, alpha, (*weights[:-1], last), (*momentum[:-1], 0.1 * last)]


BOUNDS = dict(max_grad_norm=0.5, max_state_norm=0.7)
# Every shape class the kernels admit and every switch of the rule, each once: name -> (depth, seq, chunk, widths
# (dim, hidden), parallel_memory keyword arguments); the kernels' 16-wide tiles cut widths of 20 and 40 into
# several. κ, momentum off and constant gates reach the kernels as θ, η and α themselves: "momentum off" runs η = 0.
CASES = {
    "linear, the paper's rule, residual": (1, 11, 4, (4, 8), dict(residual=True)),
    "linear, bounded, silu": (1, 11, 4, (4, 8), dict(activation="silu", **BOUNDS)),
    "deep, the default rule, recomputation groups": (2, 11, 4, (4, 8),
                                                     dict(normalize_chunk=True, checkpoint_chunks=2, **BOUNDS)),
    "depth 3, hidden step, normalised, silu": (3, 9, 4, (4, 8), dict(activation="silu", normalize_chunk=True,
                                                                          hidden_step=0.3, **BOUNDS)),
    "depth 4, chunks of one token, residual": (4, 3, 1, (4, 8), dict(residual=True, hidden_step=0.5)),
    "several tiles per product, chunk 8": (2, 12, 8, (20, 40), dict(normalize_chunk=True, **BOUNDS)),
    "momentum off (η = 0)": (2, 9, 4, (4, 8), dict(momentum_off=True, **BOUNDS)),
}


def case_args(depth, seq, dim, hidden, kwargs):
    args = on_device(inputs(seq, depth, dim, hidden))
    if kwargs.pop("momentum_off", False):
        args[4] = torch.zeros_like(args[4])
    return with_grad(args), kwargs


@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_the_reference_in_float64(case):
    """Values, end state and the gradients of every input (q, k, v, θ, η, α, W⁰, S⁰) agree with the token-by-token
    reference to float64 round-off (≤ 1e-10), the last chunk ragged."""
    depth, seq, chunk, (dim, hidden), kwargs = CASES[case]
    args, kwargs = case_args(depth, seq, dim, hidden, dict(kwargs))
    got = outputs_and_grads(args, "triton", chunk_size=chunk, **kwargs)
    if (args[4] == 0).all():  # η = 0: every chunk form gives η a zero gradient (decays.py), the recurrence not
        ref = outputs_and_grads(args, "autograd", chunk_size=chunk, **kwargs)
    else:
        kwargs.pop("checkpoint_chunks", None)
        ref = outputs_and_grads(args, None, chunk_size=chunk, **kwargs)
    assert max_diff(got[0], ref[0]) <= 1e-10
    assert max_diff(got[1], ref[1]) <= 1e-10
    if "max_grad_norm" in kwargs:  # the bounds must be active for the case to cover their backward pass
        unbounded = parallel_memory(*gated(args), rule=paper(activation=kwargs.get("activation", "gelu")),
                                    chunk_size=chunk,
                                    implementation="autograd")[0]
        assert (unbounded - got[0][0]).abs().max() > 1e-3


@pytest.mark.parametrize("loss", [c for c in LOSS_CASES if c.name != "squared"],
                         ids=[i for i, c in zip(LOSS_IDS, LOSS_CASES) if c.name != "squared"])
def test_the_inner_losses_match_the_reference_in_float64(loss):
    """Every loss of `losses.py` but the squared one (the cases above) through the kernels: the examples of
    tests/memory/test_losses.py, a gated Huber among them. Values, end state and the gradients of every input, the
    loss's gate included, as the token-by-token reference computes them from the loss's value; with the bounds and
    the normalised chunk step, and a ragged last chunk."""
    args = with_grad(on_device(inputs(11, 2)))
    gate = None
    if loss.has_gate:
        gate = (0.1 + 0.4 * torch.rand(args[3].shape, generator=torch.Generator().manual_seed(3),
                                       dtype=torch.float64)).to(DEVICE).requires_grad_()
    kwargs = dict(chunk_size=4, loss=loss, normalize_chunk=True, **BOUNDS)
    got = outputs_and_grads(args, "triton", gate=gate, **kwargs)
    ref = outputs_and_grads(args, None, gate=gate, **kwargs)
    assert max_diff(got[0], ref[0]) <= 1e-10
    assert max_diff(got[1], ref[1]) <= 1e-10


def test_a_chunk_of_64_tokens():
    """The largest chunk the kernels hold (64 rows of n × n algebra), one full chunk and a ragged one."""
    args = with_grad(on_device(inputs(70, 2, heads=1)))
    got = outputs_and_grads(args, "triton", chunk_size=64, normalize_chunk=True, **BOUNDS)
    plain = outputs_and_grads(args, "autograd", chunk_size=64, normalize_chunk=True, **BOUNDS)
    assert max_diff(got[0], plain[0]) <= 1e-10
    assert max_diff(got[1], plain[1]) <= 1e-10


@pytest.mark.parametrize("alpha", ["scalar", "per channel"])
def test_the_tiles_chosen_at_chunks_of_64_on_a_100(alpha, monkeypatch):
    """What `choose_tiles` gives at chunks of 64 on sm_80 (8 × 8, where 16 × 16 spilled more), at a chunk the
    interpreter runs quickly (the tiles are the same code at every chunk): widths 9 and 17, so two and three tiles
    a side with a ragged last one, against the token-by-token reference (≤ 1e-10), gradients included."""
    tiles = triton_chunk.choose_tiles(triton_chunk.Geometry(2, 9, 17, 9), torch.float32, 64, 80, alpha != "scalar")
    assert (tiles.BK, tiles.BN) == (8, 8)
    monkeypatch.setattr(triton_chunk, "choose_tiles", lambda *args: tiles)
    args = inputs(6, 2, dim=9, hidden=17, heads=1)
    args = with_grad(on_device(channel_alpha(args) if alpha != "scalar" else args))
    got = outputs_and_grads(args, "triton", chunk_size=4, normalize_chunk=True, **BOUNDS)
    ref = outputs_and_grads(args, None, chunk_size=4, normalize_chunk=True, **BOUNDS)
    assert max_diff(got[0], ref[0]) <= 1e-10
    assert max_diff(got[1], ref[1]) <= 1e-10


@pytest.mark.parametrize("depth", [1, 2])
def test_values_of_another_width_and_one_ragged_chunk(depth):
    """No residual, values 6 wide against keys 4 wide, and a sequence shorter than one chunk."""
    args = with_grad(on_device(with_value_width(inputs(3, depth), 6)))
    triton_out = outputs_and_grads(args, "triton", chunk_size=4, residual=False)
    plain = outputs_and_grads(args, "autograd", chunk_size=4, residual=False)
    assert triton_out[0][0].shape[-1] == 6
    assert max_diff(triton_out[0], plain[0]) <= 1e-10
    assert max_diff(triton_out[1], plain[1]) <= 1e-10


@pytest.mark.parametrize("used", [("y",), ("W",)])
def test_outputs_the_loss_leaves_out_get_no_gradient(used):
    """The backward pass gets None for an unused output (the final state, or y) and must read it as zeros."""
    args = with_grad(on_device(inputs(6, 2)))
    triton_out = outputs_and_grads(args, "triton", used=used, chunk_size=4, max_state_norm=0.7)
    plain = outputs_and_grads(args, "autograd", used=used, chunk_size=4, max_state_norm=0.7)
    assert max_diff(triton_out[1], plain[1]) <= 1e-10


def test_triton_matches_the_reference_in_float32():
    """The library's whole default rule in float32 against the token-by-token reference run in float64 on the same
    values: outputs and state within 1e-5, gradients within 1e-4 (float32 round-off through three chunks)."""
    kwargs = dict(chunk_size=4, normalize_chunk=True, **BOUNDS)
    args32 = with_grad(on_device(inputs(11, 2), torch.float32))
    args64 = with_grad(on_device(args32, torch.float64))
    got = outputs_and_grads(args32, "triton", **kwargs)
    ref = outputs_and_grads(args64, None, **kwargs)
    assert max_diff([t.double() for t in got[0]], ref[0]) <= 1e-5
    assert max_diff([t.double() for t in got[1]], ref[1]) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries_keys_values_with_a_float32_state(dtype):
    """bf16 or fp16 q, k, v are read as they are and computed in float32: the same numbers as the autograd path,
    which casts them to float32 first. y within one rounding of its dtype, state and gate gradients within 1e-5,
    the gradients of q, k, v within one rounding of their size."""
    kwargs = dict(chunk_size=4, **BOUNDS)
    args = on_device(inputs(11, 2), torch.float32)
    args[:3] = [t.to(dtype) for t in args[:3]]
    args = with_grad(args)
    got = outputs_and_grads(args, "triton", **kwargs)
    plain = outputs_and_grads(args, "autograd", **kwargs)
    assert got[0][0].dtype == dtype and all(g.dtype == dtype for g in got[1][:3])
    rounding = torch.finfo(dtype).eps
    for x, y in zip(got[0] + list(got[1]), plain[0] + list(plain[1])):
        tolerance = rounding * max(1.0, y.abs().max().item()) if y.dtype == dtype else 1e-5
        assert (x.float() - y.float()).abs().max().item() <= tolerance


def test_no_grad_forward_matches_the_recorded_one():
    args = on_device(inputs(11, 2))
    with torch.no_grad():
        quiet = parallel_memory(*gated(args), rule=paper(max_state_norm=0.7), chunk_size=4, implementation="triton")
    recorded = parallel_memory(*gated(with_grad(args)), rule=paper(max_state_norm=0.7), chunk_size=4,
                               implementation="triton")
    assert max_diff([quiet[0], *quiet[1], *quiet[2]], [recorded[0], *recorded[1], *recorded[2]]) == 0.0


def test_double_backward_is_refused_even_for_a_loss_linear_in_y():
    args = with_grad(on_device(inputs(5, 1)))
    y = parallel_memory(*gated(args), rule=paper(), chunk_size=4, implementation="triton")[0]
    with pytest.raises(RuntimeError, match="implementation='autograd'"):
        torch.autograd.grad((y * 2.0).sum(), args[3], create_graph=True)


def test_which_implementation_serves_a_call():
    """The rule in one place: CPU tensors take "fused" by default (CUDA tensors "triton" where it serves them), a
    callable θ "autograd", a channel-wise α the kernels or "autograd", and "triton" asked for where the kernels cannot
    serve the call is an error that names why."""
    q, k, v, theta, eta, alpha, weights, momentum = inputs(5, 4)
    assert serving_implementation(None, q, theta, alpha, weights) == "fused"
    if DEVICE == "cuda":
        assert serving_implementation(None, q.cuda(), theta, alpha, [w.cuda() for w in weights]) == "triton"
    assert serving_implementation("triton", q, lambda *a: theta, alpha, weights) == "autograd"
    channels = tuple(alpha.unsqueeze(-1).expand(*alpha.shape, w.shape[-1]) for w in weights)
    # a channel-wise α: the kernels or the autograd path (the fused scan takes the scalar gate only)
    assert serving_implementation(None, q, theta, channels, weights) == "autograd"
    assert serving_implementation("fused", q, theta, channels, weights) == "autograd"
    assert serving_implementation("triton", q.to(DEVICE), theta, channels, [w.to(DEVICE) for w in weights]) == "triton"
    # where the kernels run (the interpreter's CPU tensors, else CUDA's), what they cannot serve
    q, theta, alpha = (t.to(DEVICE) for t in (q, theta, alpha))
    weights = [t.to(DEVICE) for t in weights]
    deep = weights + [torch.zeros(1, 2, 4, 4, dtype=q.dtype, device=DEVICE)]
    with pytest.raises(ValueError, match="depth 5"):
        serving_implementation("triton", q, theta, alpha, deep)
    mixed = [weights[0], torch.zeros(1, 2, 8, 16, dtype=q.dtype, device=DEVICE),
             torch.zeros(1, 2, 16, 4, dtype=q.dtype, device=DEVICE)]
    with pytest.raises(ValueError, match="hidden widths"):
        serving_implementation("triton", q, theta, alpha, mixed)
    with pytest.raises(ValueError, match="chunk size 128"):
        serving_implementation("triton", q, theta, alpha, weights, chunk_size=128)
    assert serving_implementation(None, q, theta, alpha, weights, chunk_size=128) == "fused"
    with pytest.raises(ValueError, match="implementation"):
        serving_implementation("cuda", q, theta, alpha, weights)


def test_a_cuda_call_the_kernels_cannot_serve_warns_once_and_runs_fused(monkeypatch):
    """On CUDA the default falls back to the fused loop where the kernels cannot serve a call (here a depth-5 memory),
    with one warning naming why, not one per call. (CUDA is faked on the CPU: only the decision is exercised.)"""
    from titans.memory import parallel

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    parallel._warn_fallback.cache_clear()
    q, k, v, theta, eta, alpha, weights, momentum = inputs(5, 4)
    deep = (*weights, torch.zeros(1, 2, 4, 4, dtype=q.dtype))
    with pytest.warns(UserWarning, match="memory depth 5"):
        assert serving_implementation(None, q, theta, alpha, deep) == "fused"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert serving_implementation(None, q, theta, alpha, deep) == "fused"
        # a channel-wise α falls back to the autograd path (the fused scan takes the scalar gate only)
        channels = tuple(alpha.unsqueeze(-1).expand(*alpha.shape, w.shape[-1]) for w in deep)
        assert serving_implementation(None, q, theta, channels, deep) == "autograd"


def test_the_layer_runs_the_implementation_it_is_given():
    """NeuralMemory(implementation=...) reaches parallel_memory: the Triton layer gives the fused layer's numbers
    (float32, within 1e-5), and an unknown name is refused when the layer is built."""
    from titans.memory import NeuralMemory

    torch.manual_seed(0)
    layers = [NeuralMemory(8, heads=2, depth=2, expansion=2, chunk_size=4, implementation=name).to(DEVICE)
              for name in ("fused", "triton")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(1, 6, 8, device=DEVICE)
    outs = [layer(x)[0] for layer in layers]
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="implementation"):
        NeuralMemory(8, implementation="cuda")


def test_an_unknown_precision_is_refused(monkeypatch):
    monkeypatch.setenv("TITANS_TRITON_PRECISION", "fp8")
    with pytest.raises(ValueError, match="TITANS_TRITON_PRECISION='fp8'"):
        triton_chunk.precision()


# --- compiled for a GPU, without one ------------------------------------------------------------------------------
