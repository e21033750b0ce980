"""The Triton kernels (`triton_scan.py`) against the autograd dual form and the token-by-token reference.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, numpy on CPU tensors, set here before
`titans.memory.triton_scan` is imported), so they are held to the reference on every machine where triton is
installed; with a GPU they run compiled, on CUDA tensors. Shapes are small (dim 4, hidden 8, 2–3 chunks of 4 with a
ragged last one): the interpreter runs every program of the grid one after the other in numpy. The interpreter runs
any Python, so the kernels are also compiled for an sm_90 GPU here (`compile_for_gpu.py`), as a GPU would compile
them.
"""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it first, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -c constraints.txt -e '.[gpu]')")

import triton  # noqa: E402

from titans.memory import parallel_memory, sequential_memory, triton_scan  # noqa: E402
from titans.memory.parallel import serving_implementation  # noqa: E402

from .test_functional import flat, make_inputs, max_diff, with_grad  # noqa: E402

DEVICE = "cpu" if triton_scan.INTERPRET else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("triton_scan was imported without TRITON_INTERPRET=1 and there is no GPU", allow_module_level=True)


def inputs(seq, depth):
    """One batch row of two heads (the kernels' grid: two programs)."""
    return make_inputs(batch=1, heads=2, seq=seq, depth=depth)


def on_device(args, dtype=None):
    def move(t):
        return t.detach().to(DEVICE, dtype or t.dtype)
    return [tuple(move(t) for t in a) if isinstance(a, tuple) else move(a) for a in args]


def outputs_and_grads(args, implementation, used=("y", "W", "S"), **kwargs):
    """The outputs, and the gradients of every input of a random linear loss of the outputs named in `used`;
    implementation None: the token-by-token reference."""
    if implementation is None:
        y, W, S = sequential_memory(*args, **kwargs)
    else:
        y, W, S = parallel_memory(*args, implementation=implementation, **kwargs)
    outs = {"y": [y], "W": list(W), "S": list(S)}
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype)).sum()
               for name in used for o in outs[name])
    grads = torch.autograd.grad(loss, flat(args), allow_unused=True)
    return [y, *W, *S], [torch.zeros_like(x) if d is None else d for d, x in zip(grads, flat(args))]


def with_value_width(args, width):
    """Inputs without the residual's constraint: values (and the last layer's output) `width` wide."""
    q, k, v, theta, eta, alpha, weights, momentum = args
    g = torch.Generator().manual_seed(5)
    v = torch.randn(*v.shape[:3], width, generator=g, dtype=v.dtype)
    last = torch.randn(*weights[-1].shape[:3], width, generator=g, dtype=v.dtype) / weights[-1].shape[2] ** 0.5
    return [q, k, v, theta, eta, alpha, (*weights[:-1], last), (*momentum[:-1], 0.1 * last)]


RULES = {  # name: (depth, parallel_memory keyword arguments)
    "linear": (1, dict()),
    "linear-bounded-silu-no-residual": (1, dict(activation="silu", residual=False, max_grad_norm=0.5,
                                                max_state_norm=0.7)),
    "deep": (2, dict()),
    "deep-bounded": (2, dict(max_grad_norm=0.5, max_state_norm=0.7)),
    "deep-normalized-hidden-step-silu": (2, dict(activation="silu", normalize_chunk=True, hidden_step=0.3)),
    "deep-default-rule-groups": (2, dict(max_grad_norm=0.5, max_state_norm=0.7, normalize_chunk=True,
                                         checkpoint_chunks=2)),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_triton_matches_autograd_in_float64(rule):
    """Values, end state and the gradients of every input (q, k, v, θ, η, α, W⁰, S⁰) agree with the autograd path to
    float64 round-off (≤ 1e-10): 11 tokens in chunks of 4, the last one ragged."""
    depth, kwargs = RULES[rule]
    args = with_grad(on_device(inputs(11, depth)))
    triton_out = outputs_and_grads(args, "triton", chunk_size=4, **kwargs)
    plain = outputs_and_grads(args, "autograd", chunk_size=4, **kwargs)
    assert max_diff(triton_out[0], plain[0]) <= 1e-10
    assert max_diff(triton_out[1], plain[1]) <= 1e-10
    if "max_grad_norm" in kwargs:  # the bounds must be active for the case to cover their backward pass
        unbounded = parallel_memory(*args, chunk_size=4, implementation="autograd",
                                    activation=kwargs.get("activation", "gelu"),
                                    residual=kwargs.get("residual", True))[0]
        assert (unbounded - triton_out[0][0]).abs().max() > 1e-3


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
    kwargs = dict(chunk_size=4, max_grad_norm=0.5, max_state_norm=0.7, normalize_chunk=True)
    args32 = with_grad(on_device(inputs(11, 2), torch.float32))
    args64 = with_grad(on_device(args32, torch.float64))
    got = outputs_and_grads(args32, "triton", **kwargs)
    ref = outputs_and_grads(args64, None, **kwargs)
    assert max_diff([t.double() for t in got[0]], ref[0]) <= 1e-5
    assert max_diff([t.double() for t in got[1]], ref[1]) <= 1e-4


def test_bf16_queries_keys_values_with_a_float32_state():
    """bf16 q, k, v are read as they are and computed in float32: the same numbers as the autograd path, which casts
    them to float32 first. y (bf16) within one bf16 rounding (2⁻⁷ relative), state and gate gradients within 1e-5,
    the bf16 gradients of q, k, v within one rounding of their size."""
    kwargs = dict(chunk_size=4, max_grad_norm=0.5, max_state_norm=0.7)
    args = on_device(inputs(11, 2), torch.float32)
    args[:3] = [t.bfloat16() for t in args[:3]]
    args = with_grad(args)
    got = outputs_and_grads(args, "triton", **kwargs)
    plain = outputs_and_grads(args, "autograd", **kwargs)
    assert got[0][0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got[1][:3])
    for x, y in zip(got[0] + list(got[1]), plain[0] + list(plain[1])):
        tolerance = 2**-7 * max(1.0, y.abs().max().item()) if y.dtype == torch.bfloat16 else 1e-5
        assert (x.float() - y.float()).abs().max().item() <= tolerance


def test_no_grad_forward_matches_the_recorded_one():
    args = on_device(inputs(11, 2))
    with torch.no_grad():
        quiet = parallel_memory(*args, chunk_size=4, max_state_norm=0.7, implementation="triton")
    recorded = parallel_memory(*with_grad(args), chunk_size=4, max_state_norm=0.7, implementation="triton")
    assert max_diff([quiet[0], *quiet[1], *quiet[2]], [recorded[0], *recorded[1], *recorded[2]]) == 0.0


def test_double_backward_is_refused_even_for_a_loss_linear_in_y():
    args = with_grad(on_device(inputs(5, 1)))
    y = parallel_memory(*args, chunk_size=4, implementation="triton")[0]
    with pytest.raises(RuntimeError, match="implementation='autograd'"):
        torch.autograd.grad((y * 2.0).sum(), args[3], create_graph=True)


def test_which_implementation_serves_a_call():
    """The rule in one place: CPU tensors take "fused" by default (CUDA tensors "triton" where it serves them), a
    callable θ and a channel-wise α "autograd", and "triton" asked for where the kernels cannot serve the call is an
    error that names why."""
    q, k, v, theta, eta, alpha, weights, momentum = inputs(5, 3)
    assert serving_implementation(None, q, theta, alpha, weights[:2]) == "fused"
    if DEVICE == "cuda":
        assert serving_implementation(None, q.cuda(), theta, alpha, [w.cuda() for w in weights[:2]]) == "triton"
    assert serving_implementation("triton", q, lambda *a: theta, alpha, weights) == "autograd"
    channels = tuple(alpha.unsqueeze(-1).expand(*alpha.shape, w.shape[-1]) for w in weights)
    assert serving_implementation("triton", q, theta, channels, weights) == "autograd"
    # where the kernels run (the interpreter's CPU tensors, else CUDA's), what they cannot serve
    q, k, v, theta, eta, alpha = (t.to(DEVICE) for t in (q, k, v, theta, eta, alpha))
    weights, momentum = ([t.to(DEVICE) for t in ts] for ts in (weights, momentum))
    with pytest.raises(ValueError, match="depth 3"):
        parallel_memory(q, k, v, theta, eta, alpha, weights, momentum, implementation="triton")
    big = (torch.zeros(2, 2, 4, 2048, dtype=q.dtype, device=DEVICE),
           torch.zeros(2, 2, 2048, 4, dtype=q.dtype, device=DEVICE))
    with pytest.raises(ValueError, match="on chip"):
        serving_implementation("triton", q, theta, alpha, big)
    with pytest.raises(ValueError, match="chunk size 32"):
        serving_implementation("triton", q, theta, alpha, weights[:2], chunk_size=32)
    assert serving_implementation(None, q, theta, alpha, weights[:2], chunk_size=32) == "fused"
    with pytest.raises(ValueError, match="implementation"):
        serving_implementation("cuda", q, theta, alpha, weights)


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


# --- compiled for a GPU, without one ------------------------------------------------------------------------------

KERNELS = ("_scan_forward_kernel", "_scan_backward_kernel")
TRITON_TYPES = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.int32: "i32", torch.int64: "i64"}


def argument_type(value) -> str:
    """Triton's signature type of a kernel argument as it reaches the kernel."""
    if isinstance(value, torch.Tensor):
        return "*" + TRITON_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a kernel argument of type {type(value).__name__}")


class LaunchRecorder:
    """Stands in for a kernel: records each launch's argument types and constexprs (a Triton dtype as "dtype:NAME"),
    then launches it."""

    def __init__(self, name: str, kernel, launches: list):
        self.name, self.kernel, self.launches = name, kernel, launches
        self.signature = inspect.signature(kernel.fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            signature, constexprs = {}, {}
            for name, value in self.signature.bind(*args, **kwargs).arguments.items():
                if self.signature.parameters[name].annotation in ("tl.constexpr", triton.language.constexpr):
                    signature[name] = "constexpr"
                    constexprs[name] = f"dtype:{value}" if isinstance(value, triton.language.dtype) else value
                else:
                    signature[name] = argument_type(value)
            record = dict(kernel=self.name, signature=signature, constexprs=constexprs)
            if record not in self.launches:
                self.launches.append(record)
            return self.kernel[grid](*args, **kwargs)
        return launch


def largest_admitted_shapes() -> list[dict]:
    """The tiles of the largest memories `unsupported` lets the kernels serve: every split of MAX_STATE_BLOCK into
    d_in × hidden (values as wide as keys), at the largest chunk."""
    shapes = []
    for d_in in (16, 32, 64, 128):
        hidden = triton_scan.MAX_STATE_BLOCK // d_in
        q = torch.zeros(1, 1, d_in, device=DEVICE)
        weights = (torch.zeros(1, d_in, hidden, device=DEVICE), torch.zeros(1, hidden, d_in, device=DEVICE))
        if hidden >= 16 and triton_scan.unsupported(q, weights, triton_scan.MAX_CHUNK_BLOCK) is None:
            shapes.append(dict(BD=d_in, BN1=hidden, BV=d_in, CH=triton_scan.MAX_CHUNK_BLOCK,
                               BN=triton_scan.MAX_CHUNK_BLOCK))
    return shapes


@pytest.mark.slow
def test_the_kernels_compile_for_an_h100(monkeypatch, tmp_path):
    """What the interpreter lets through, a GPU's compiler need not: a compiled kernel reads a module global only as
    a tl.constexpr (an H100 refused the GELU kernels over a plain float), and a program must fit the chip's shared
    memory (it refused a 64 × 128 state that `unsupported` then admitted). So the kernels, as the cases here launch
    them, are compiled for sm_90 by triton's compiler and ptxas; and at the largest shapes `unsupported` admits, with
    bf16 inputs and a float32 state as a model trains, they ask for at most SHARED_MEMORY_LIMIT."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton has no CUDA backend here")
    launches = []
    for name in KERNELS:
        monkeypatch.setattr(triton_scan, name, LaunchRecorder(name, getattr(triton_scan, name), launches))
    for rule in ("linear-bounded-silu-no-residual", "deep-default-rule-groups"):
        depth, kwargs = RULES[rule]
        outputs_and_grads(with_grad(on_device(inputs(11, depth))), "triton", chunk_size=4, **kwargs)
    trained = on_device(inputs(11, 2), torch.float32)
    trained[:3] = [t.bfloat16() for t in trained[:3]]
    outputs_and_grads(with_grad(trained), "triton", chunk_size=4, max_grad_norm=0.5, max_state_norm=0.7)
    assert {launch["kernel"] for launch in launches} == set(KERNELS)
    bf16 = [launch for launch in launches if launch["signature"]["q_ptr"] == "*bf16"]
    shapes = largest_admitted_shapes()
    assert shapes and len(bf16) == 2
    to_compile = [dict(launch, ptxas=True) for launch in launches]
    to_compile += [dict(launch, ptxas=False, constexprs={**launch["constexprs"], **shape})
                   for launch in bf16 for shape in shapes]
    (tmp_path / "launches.json").write_text(json.dumps(to_compile))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_for_gpu.py")),
                           str(tmp_path / "launches.json")], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    for launch, result in zip(to_compile, json.loads(done.stdout.splitlines()[-1]), strict=True):
        where = (launch["kernel"], launch["signature"]["q_ptr"], launch["constexprs"])
        assert "error" not in result, (where, result.get("error"))
        assert result["shared"] <= triton_scan.SHARED_MEMORY_LIMIT, (where, result["shared"])
