"""The C++ state kernels (`state_ops.py`) against their ATen references, and the fused scan with them against
the scan without. The kernels are float32; the references are held to float64 products of the same inputs."""

import pytest
import torch

from titans.memory import Gates, MemoryRule, parallel_memory, state_ops
from titans.memory.state_ops import Momentum, Wanted

needs_kernels = pytest.mark.skipif(state_ops.state_kernels() is None,
                                   reason="state kernels unavailable here (no AVX-512 or no C++ compiler)")

# (batch, rows n, K, N): 16-row blocks, padded row counts (17, 40), several row blocks (48), every column-block
# width the update kernel has (N = 16, 32, 64, 128 and beyond), and the benchmark's orientations.
SHAPES = [(3, 16, 64, 128), (2, 17, 48, 32), (1, 48, 32, 256), (2, 8, 40, 16), (2, 40, 96, 64), (1, 16, 256, 1024),
          (1, 16, 1024, 256), (2, 16, 300, 272)]


def rel_err(x: torch.Tensor, exact: torch.Tensor) -> float:
    return ((x.double() - exact).abs().max() / exact.abs().max()).item()


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_xw_and_xwt_match_their_references(shape, accumulate):
    B, n, K, N = shape
    x, g, W = torch.randn(B, n, K), torch.randn(B, n, N), torch.randn(B, K, N)
    start_xw, start_xwt = torch.randn(B, n, N), torch.randn(B, n, K)
    out_xw, out_xwt = start_xw.clone(), start_xwt.clone()
    state_ops.xw(x, W, out=out_xw, accumulate=accumulate)
    state_ops.xwt(g, W, out=out_xwt, accumulate=accumulate)
    exact_xw = x.double() @ W.double() + (start_xw.double() if accumulate else 0)
    exact_xwt = g.double() @ W.double().transpose(1, 2) + (start_xwt.double() if accumulate else 0)
    assert rel_err(out_xw, exact_xw) < 1e-5
    assert rel_err(out_xwt, exact_xwt) < 1e-5
    assert rel_err(state_ops.xw(x, W), x.double() @ W.double()) < 1e-5  # fresh output


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES)
def test_combine_matches_its_reference(shape):
    B, n, K, N = shape
    W, S, A, G = torch.randn(B, K, N), torch.randn(B, K, N), torch.randn(B, n, K), torch.randn(B, n, N)
    beta, c = torch.rand(B), torch.rand(B, 1)  # any shape with one value per batch element
    P = torch.randn(B, K, N)
    out = torch.full_like(W, float("nan"))  # every element must be written
    dots = state_ops.combine(out, W, beta, A, G, -0.7, Momentum(S, c), Wanted(dots_with=P)).dots
    exact = (beta.double().view(-1, 1, 1) * W.double() + c.double().view(-1, 1, 1) * S.double()
             - 0.7 * A.double().transpose(1, 2) @ G.double())
    assert rel_err(out, exact) < 1e-5
    exact_dots = torch.stack([(P.double() * W.double()).sum((1, 2)), (P.double() * S.double()).sum((1, 2))], 1)
    assert dots.dtype == torch.float32 and rel_err(dots, exact_dots) < 1e-5
    # Both forward updates from one pass: W' = β W + c S − Aᵀ G and S' = e S − Aᵀ G2.
    e, G2 = torch.rand(B), torch.randn(B, n, N)
    out, out2 = torch.full_like(W, float("nan")), torch.full_like(W, float("nan"))
    state_ops.combine(out, W, beta, A, G, -1.0, Momentum(S, c, out2, e, G2))
    exact2 = e.double().view(-1, 1, 1) * S.double() - A.double().transpose(1, 2) @ G2.double()
    exact = (beta.double().view(-1, 1, 1) * W.double() + c.double().view(-1, 1, 1) * S.double()
             - A.double().transpose(1, 2) @ G.double())
    assert rel_err(out, exact) < 1e-5 and rel_err(out2, exact2) < 1e-5
    # In place, without S: the backward pass's W ← β W + Aᵀ G, with ⟨P, W⟩ of W before the update.
    exact = beta.double().view(-1, 1, 1) * W.double() + A.double().transpose(1, 2) @ G.double()
    dot_before = (P.double() * W.double()).sum((1, 2))
    dots = state_ops.combine(W, W, beta, A, G, 1.0, wanted=Wanted(dots_with=P)).dots
    assert rel_err(W, exact) < 1e-5
    assert rel_err(dots[:, 0], dot_before) < 1e-5 and (dots[:, 1] == 0).all()
    assert state_ops.combine(W, W, beta, A, G, 1.0) == (None,) * 5


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ["same", "other"])  # rows of x and of the g's: n, or counts of their own
def test_combine_returns_the_products_of_its_inputs(shape, rows):
    # The scan takes every product of a chunk with a state from the update's one pass over it: the queries' h W⁰, h S⁰
    # beside W', S' (forward), and a ∂W', a ∂S', ∂a, ∂h beside ∂S⁰ (backward, in place when out is W).
    B, n, K, N = shape
    mx, mg = (n, n) if rows == "same" else (n + 4, 2 * n + 1)
    W, S, P, Q = (torch.randn(B, K, N) for _ in range(4))
    A, G, G2 = torch.randn(B, n, K), torch.randn(B, n, N), torch.randn(B, n, N)
    x, gt = torch.randn(B, 2 * mx, K)[:, ::2], [torch.randn(B, mg, N) for _ in range(4)]  # x: rows strided
    beta, c, e = torch.rand(B), torch.rand(B), torch.rand(B)
    d = {name: t.double() for name, t in dict(W=W, S=S, P=P, Q=Q, A=A, G=G, G2=G2, x=x).items()}
    b_, c_, e_ = (t.double().view(-1, 1, 1) for t in (beta, c, e))
    out, out2 = torch.full_like(W, float("nan")), torch.full_like(W, float("nan"))
    reads = state_ops.combine(out, W, beta, A, G, -1.0, Momentum(S, c, out2, e, G2), Wanted(x=x))
    assert rel_err(out, b_ * d["W"] + c_ * d["S"] - d["A"].transpose(1, 2) @ d["G"]) < 1e-5
    assert rel_err(out2, e_ * d["S"] - d["A"].transpose(1, 2) @ d["G2"]) < 1e-5
    assert rel_err(reads.xW, d["x"] @ d["W"]) < 1e-5 and rel_err(reads.xS, d["x"] @ d["S"]) < 1e-5
    assert reads.dots is None and reads.gWt is None and reads.gPt is None
    exact = b_ * d["W"] + c_ * d["S"] + d["A"].transpose(1, 2) @ d["G"]
    exact_reads = (torch.stack([(d["P"] * d["W"]).sum((1, 2)), (d["P"] * d["S"]).sum((1, 2))], 1),
                   d["x"] @ d["W"], d["x"] @ d["S"],
                   gt[0].double() @ d["W"].transpose(1, 2) + gt[1].double() @ d["S"].transpose(1, 2),
                   gt[2].double() @ d["P"].transpose(1, 2) + gt[3].double() @ d["Q"].transpose(1, 2))
    W_in_place = W.clone()
    for target, source in ((torch.full_like(W, float("nan")), W), (W_in_place, W_in_place)):
        reads = state_ops.combine(target, source, beta, A, G, 1.0, Momentum(S, c), Wanted(P, x, gt, Q))
        assert rel_err(target, exact) < 1e-5
        for got, want in zip(reads, exact_reads):
            assert rel_err(got, want) < 1e-5


def test_combine_refuses_products_it_cannot_form():
    W, A, G = torch.randn(1, 16, 32), torch.randn(1, 16, 16), torch.randn(1, 16, 32)
    with pytest.raises(ValueError, match="x needs S"):
        state_ops.combine(torch.empty_like(W), W, torch.ones(1), A, G, 1.0, wanted=Wanted(x=A))
    with pytest.raises(ValueError, match="gt .* and Q go together"):
        state_ops.combine(torch.empty_like(W), W, torch.ones(1), A, G, 1.0, Momentum(W, torch.ones(1)),
                          Wanted(dots_with=W, gt=[G] * 4))


@needs_kernels
@pytest.mark.parametrize("with_second", [False, True])
def test_combine_reads_blocks_of_rows_in_place(with_second):
    # The backward pass hands its rank-n terms over as blocks of rows (h, ∂m, a with their partners), some of them
    # strided views, instead of concatenating them; blocks of different heights cross the 16-row register blocks.
    B, K, N = 2, 64, 128
    heights = [16, 9, 23]
    A = [torch.randn(B, 2 * m, K)[:, ::2] for m in heights]  # rows 2·K apart
    G = [torch.randn(B, m, N) for m in heights]
    G2 = [torch.randn(B, N + 16, m).transpose(1, 2)[:, :, :N].contiguous() for m in heights] if with_second else None
    W, S, beta, c, e = torch.randn(B, K, N), torch.randn(B, K, N), torch.rand(B), torch.rand(B), torch.rand(B)
    out, out2 = torch.full_like(W, float("nan")), torch.full_like(W, float("nan")) if with_second else None
    state_ops.combine(out, W, beta, A, G, 0.5, Momentum(S, c, out2, e if with_second else None, G2))
    At = torch.cat(A, 1).double().transpose(1, 2)
    exact = (beta.double().view(-1, 1, 1) * W.double() + c.double().view(-1, 1, 1) * S.double()
             + 0.5 * At @ torch.cat(G, 1).double())
    assert rel_err(out, exact) < 1e-5
    if with_second:
        exact2 = e.double().view(-1, 1, 1) * S.double() + 0.5 * At @ torch.cat(G2, 1).double()
        assert rel_err(out2, exact2) < 1e-5


@needs_kernels
def test_kernels_honour_views_of_the_small_operands():
    # The scan passes slices of [batch, seq, d] tensors (rows strided) and transposed gate products.
    B, n, K, N = 2, 16, 64, 128
    x = torch.randn(B, 3 * n, K)[:, n : 2 * n]
    g = torch.randn(B, N, n).transpose(1, 2)
    W = torch.randn(B, K, N)
    assert rel_err(state_ops.xw(x, W), x.double() @ W.double()) < 1e-5
    assert rel_err(state_ops.xwt(g, W), g.double() @ W.double().transpose(1, 2)) < 1e-5


class _Refuse:
    """A module with state kernels that answers the real rule (`kernel_serves`) and fails if a kernel is called."""

    STATE_KERNELS = True
    MIN_ROWS = 8

    def kernel_serves(self, W, rows):
        return W.dtype is torch.float32 and W.dim() == 3 and W.is_contiguous() and W.shape[2] % 16 == 0 and rows >= 8

    def __getattr__(self, name):
        raise AssertionError(f"kernel {name} called for inputs it does not serve")


@pytest.mark.parametrize("case", ["float64", "narrow_N", "few_rows", "strided_W"])
def test_inputs_the_kernels_do_not_serve_take_the_reference(monkeypatch, case):
    """Operands the rule refuses never reach a kernel (the rule itself is tested against the compiled one in
    test_native_scan.py)."""
    monkeypatch.setitem(state_ops._loaded, "module", _Refuse())
    B, n, K, N = 2, 16, 32, 64
    dtype = torch.float64 if case == "float64" else torch.float32
    if case == "narrow_N":
        N = 24
    if case == "few_rows":
        n = _Refuse.MIN_ROWS - 1
    x, g, A = torch.randn(B, n, K, dtype=dtype), torch.randn(B, n, N, dtype=dtype), torch.randn(B, n, K, dtype=dtype)
    W = torch.randn(B, N, K, dtype=dtype).transpose(1, 2) if case == "strided_W" else torch.randn(B, K, N, dtype=dtype)
    torch.testing.assert_close(state_ops.xw(x, W), x @ W)
    torch.testing.assert_close(state_ops.xwt(g, W), g @ W.transpose(1, 2))
    beta = torch.rand(B, dtype=dtype)
    out, P = torch.empty(B, K, N, dtype=dtype), torch.randn(B, K, N, dtype=dtype)
    dots = state_ops.combine(out, W, beta, A, g, 2.0, wanted=Wanted(dots_with=P)).dots
    torch.testing.assert_close(out, beta.view(-1, 1, 1) * W + 2.0 * A.transpose(1, 2) @ g)
    torch.testing.assert_close(dots[:, 0], (P * W).sum((1, 2)))
    S, out2, e = torch.randn(B, K, N, dtype=dtype), torch.empty(B, K, N, dtype=dtype), torch.rand(B, dtype=dtype)
    state_ops.combine(out, W, beta, A, g, -1.0, Momentum(S, beta, out2, e, 2 * g))
    torch.testing.assert_close(out2, e.view(-1, 1, 1) * S - 2.0 * A.transpose(1, 2) @ g)
    reads = state_ops.combine(out, W, beta, A, g, 1.0, Momentum(S, beta),
                              Wanted(dots_with=P, x=x, gt=[g, 2 * g, 3 * g, 4 * g], Q=W))
    torch.testing.assert_close(reads.xW, x @ W)
    torch.testing.assert_close(reads.xS, x @ S)
    torch.testing.assert_close(reads.gWt, g @ W.transpose(1, 2) + 2 * g @ S.transpose(1, 2))
    torch.testing.assert_close(reads.gPt, 3 * g @ P.transpose(1, 2) + 4 * g @ W.transpose(1, 2))


def test_without_kernels_the_library_warns_once_and_uses_the_references(monkeypatch):
    monkeypatch.setenv("TITANS_KERNELS", "0")
    monkeypatch.setattr(state_ops, "_loaded", {})
    with pytest.warns(UserWarning, match="TITANS_KERNELS=0"):
        assert state_ops.kernels() is None
    x, W = torch.randn(2, 16, 32), torch.randn(2, 32, 64)
    torch.testing.assert_close(state_ops.xw(x, W), x @ W)


def test_kernels_demanded_but_unavailable_is_an_error(monkeypatch):
    monkeypatch.setenv("TITANS_KERNELS", "1")
    monkeypatch.setattr(state_ops, "_loaded", {})
    monkeypatch.setattr(state_ops, "_why_not_buildable", lambda flags: "no C++ compiler (c++ or $CXX) on PATH")
    with pytest.raises(RuntimeError,
                       match="TITANS_KERNELS=1 but the state kernels are unavailable: no C\\+\\+ compiler"):
        state_ops.kernels()


def _scan(monkeypatch, with_kernels: bool, seq: int, chunk_size: int):
    if not with_kernels:
        monkeypatch.setitem(state_ops._loaded, "module", None)
    torch.manual_seed(1)
    B, H, d, hidden = 2, 2, 32, 64
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, seq, d), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, seq, d).requires_grad_()
    theta = (0.1 * torch.rand(B, H, seq)).requires_grad_()
    eta, alpha = torch.rand(B, H, seq).requires_grad_(), (0.05 * torch.rand(B, H, seq)).requires_grad_()
    weights = tuple((0.2 * torch.randn(B, H, a, b)).requires_grad_() for a, b in [(d, hidden), (hidden, d)])
    y, new_w, new_m = parallel_memory(q, k, v, Gates(theta, eta, alpha), weights, rule=MemoryRule.paper(),
                                      chunk_size=chunk_size)
    loss = y.pow(2).sum() + sum((w * torch.cos(w)).sum() for w in (*new_w, *new_m))
    loss.backward()
    inputs = (q, k, v, theta, eta, alpha, *weights)
    return [y, *new_w, *new_m] + [t.grad for t in inputs]


@needs_kernels
@pytest.mark.parametrize("seq,chunk_size", [(64, 16), (70, 16), (72, 24)])
def test_fused_scan_with_kernels_matches_the_scan_without(monkeypatch, seq, chunk_size):
    # 70 tokens: a 6-token ragged chunk (the reference path) after four kernel chunks; chunk 24: two row blocks.
    with_kernels = _scan(monkeypatch, True, seq, chunk_size)
    without = _scan(monkeypatch, False, seq, chunk_size)
    for a, b in zip(with_kernels, without):
        assert rel_err(a, b.double()) < 2e-5


@pytest.mark.parametrize("built", [False, True])
def test_the_first_build_says_so_in_one_line(monkeypatch, capsys, tmp_path, built):
    """A first build takes about a minute: one line on stderr before it starts, nothing when the cache has it."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(state_ops, "_why_not_buildable", lambda flags: None)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda name, *args, **kwargs: f"module {name}")
    if built:
        (tmp_path / "titans_state_ops_x.so").touch()
        monkeypatch.setattr(state_ops.hashlib, "sha1", lambda key: type("H", (), {"hexdigest": lambda self: "x"})())
    assert state_ops._build().startswith("module titans_state_ops_")
    err = capsys.readouterr().err
    assert (err == "") if built else (err.count("\n") == 1 and "building the CPU kernels (first use" in err), err


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_three_named_passes_compute_what_they_say(dtype):
    """update_state, momentum_grad and weight_grad (the scan's three uses of `combine`) against their formulas in
    float64: on the ATen reference for float64, on the kernels for float32 where they are built."""
    torch.manual_seed(0)
    B, n, K, N = 2, 16, 32, 64

    def r(*shape):
        return torch.randn(*shape, dtype=dtype)

    def f64(t):
        return t.double()

    def batch(x):
        return f64(x).view(-1, 1, 1)

    tol = 1e-12 if dtype is torch.float64 else 1e-5
    W, S, a, h = r(B, K, N), r(B, K, N), r(B, n, K), r(B, n, K)
    beta, c, e = torch.rand(B, dtype=dtype), torch.rand(B, dtype=dtype), torch.rand(B, dtype=dtype)
    steps = state_ops.Pair(r(B, n, N), r(B, n, N))
    new = state_ops.Pair(torch.full_like(W, float("nan")), torch.full_like(S, float("nan")))
    reads = state_ops.update_state(new, state_ops.Pair(W, S), (beta, c, e), a, steps, h)
    at = f64(a).transpose(1, 2)
    assert rel_err(new.W, batch(beta) * f64(W) + batch(c) * f64(S) - at @ f64(steps.W)) < tol
    assert rel_err(new.S, batch(e) * f64(S) - at @ f64(steps.S)) < tol
    assert rel_err(reads.W, f64(h) @ f64(W)) < tol and rel_err(reads.S, f64(h) @ f64(S)) < tol

    dW, dS, out = r(B, K, N), r(B, K, N), torch.full_like(W, float("nan"))
    update, query = state_ops.Pair(r(B, n, N), r(B, n, N)), state_ops.Pair(r(B, n, N), r(B, n, N))
    grad = state_ops.momentum_grad(out, state_ops.Pair(dW, dS), state_ops.Pair(W, S), (c, e), h, a, (update, query))
    assert rel_err(out, batch(e) * f64(dS) + batch(c) * f64(dW) + f64(h).transpose(1, 2) @ f64(query.S)) < tol
    assert rel_err(grad.d_e, (f64(S) * f64(dS)).sum((1, 2))) < tol
    assert rel_err(grad.d_c, (f64(S) * f64(dW)).sum((1, 2))) < tol
    assert rel_err(grad.a_dS, f64(a) @ f64(dS)) < tol and rel_err(grad.a_dW, f64(a) @ f64(dW)) < tol
    T = (1, 2)
    assert rel_err(grad.a_grad, f64(update.S) @ f64(dS).transpose(*T) + f64(update.W) @ f64(dW).transpose(*T)) < tol
    assert rel_err(grad.h_grad, f64(query.W) @ f64(W).transpose(*T) + f64(query.S) @ f64(S).transpose(*T)) < tol

    left, right = [r(B, n, K), r(B, 8, K)], [r(B, n, N), r(B, 8, N)]
    out = torch.full_like(W, float("nan"))
    d_beta = state_ops.weight_grad(out, dW, beta, left, right, W)
    exact = batch(beta) * f64(dW) + sum(f64(x).transpose(1, 2) @ f64(y) for x, y in zip(left, right))
    assert rel_err(out, exact) < tol and rel_err(d_beta, (f64(W) * f64(dW)).sum((1, 2))) < tol
