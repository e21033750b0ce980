"""The three state-sized products of the fused scan, each a C++ kernel with its ATen reference beside it.

Every way a chunk touches a state matrix W `[batch, K, N]` (the memory's weights, momentum and their
gradients) is one of

    xw(x, W)                      x W          x: [batch, n, K]   (keys, ∂δ)
    xwt(g, W)                     g Wᵀ         g: [batch, n, N]   (δ W_{i+1}ᵀ, ∂a)
    combine(out, W, β, A, G, α)   β W + c S + α Aᵀ G              (the state update, ∂W⁰, ∂S⁰)

with n = 16 rows (a chunk). A training step's states do not fit in cache, so each product streams its matrix
from DRAM, and MKL's small-row kernels wait on memory latency there (`titans bench matmul` measures both on
this machine; the history of these kernels is docs/PERFORMANCE.md). `kernels/state_ops.cpp` walks W in the order it uses
it and prefetches the next strip into L2 while computing the current one, and `combine` does the state
update in one pass over W and S instead of four. That pass also returns the other products of the same
inputs that a chunk needs at that point (`Reads`: the queries' h W⁰ and h S⁰ in the forward pass; a ∂W',
a ∂S', ∂a and ∂h in the backward), so each of them costs no further read of the state.

The kernels serve float32 CPU tensors whose W is contiguous with N a multiple of 16 and enough rows in x (one rule,
`kernel_serves` in `kernels/scan.cpp`, which this module asks too), on x86-64 CPUs with AVX-512; they are compiled
on first use (`torch.utils.cpp_extension`, about a minute, cached), into one module with the fused scan's chunk
loop (`kernels/scan.cpp`), which is built on every x86-64 Linux machine with a compiler and takes the ATen products
where the state kernels are absent. Anything else, a machine without a compiler, or `TITANS_KERNELS=0` takes the
ATen reference, which is also what float64 (every exactness test) runs. `tests/memory/test_state_ops.py` holds each
kernel to its reference, and the fused scan with kernels to the scan without.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

_KERNELS = Path(__file__).with_name("kernels")
_SOURCES = [_KERNELS / "state_ops.cpp", _KERNELS / "scan.cpp"]
_HEADERS = [_KERNELS / "state_ops.h", _KERNELS / "losses.h"]  # what they include
Rows = Union[Tensor, Sequence[Tensor]]  # a small operand, or blocks of its rows: [batch, m_j, d] stacked along m

# --- the references ----------------------------------------------------------------------------------


def xw_reference(x: Tensor, W: Tensor, out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    if accumulate:
        return out.baddbmm_(x, W)
    return torch.bmm(x, W, out=out) if out is not None else torch.bmm(x, W)


def xwt_reference(g: Tensor, W: Tensor, out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    return xw_reference(g, W.transpose(1, 2), out, accumulate)


class Reads(NamedTuple):
    """What `combine` also computes from its reads of the inputs, before its writes (None where not asked for)."""

    dots: Optional[Tensor]  # [batch, 2]: ⟨P, W⟩, ⟨P, S⟩
    xW: Optional[Tensor]  # x W   [batch, m, N]
    xS: Optional[Tensor]  # x S
    gWt: Optional[Tensor]  # g_W Wᵀ + g_S Sᵀ   [batch, m, K]
    gPt: Optional[Tensor]  # g_P Pᵀ + g_Q Qᵀ


class Momentum(NamedTuple):
    """The momentum's part of a `combine`: `+ c S` in `out`, and with `out2` (e, G2) also `out2 = e S + α Aᵀ G2`
    from the same reads of S. `Momentum()`: none (out = β W + α Aᵀ G)."""

    S: Optional[Tensor] = None
    c: Optional[Tensor] = None
    out2: Optional[Tensor] = None
    e: Optional[Tensor] = None
    G2: Optional[Rows] = None


class Wanted(NamedTuple):
    """The products a `combine` reads for its caller beside its writes (`Reads`): with `dots_with` P, ⟨P, W⟩ and
    ⟨P, S⟩; with `x`, x W and x S; with `gt` = (g_W, g_S, g_P, g_Q) and Q, g_W Wᵀ + g_S Sᵀ and g_P Pᵀ + g_Q Qᵀ."""

    dots_with: Optional[Tensor] = None
    x: Optional[Tensor] = None
    gt: Optional[Sequence[Tensor]] = None
    Q: Optional[Tensor] = None


def combine_reference(out: Tensor, W: Tensor, beta: Tensor, A: Rows, G: Rows, alpha: float,
                      momentum: Momentum = Momentum(), wanted: Wanted = Wanted()) -> Reads:
    S, c, out2, e, G2 = momentum
    dots_with, x, gt, Q = wanted
    A, G, G2 = (torch.cat(t, 1) if isinstance(t, (list, tuple)) else t for t in (A, G, G2))
    # Everything read from W and S before `out` (which may be W) is written.
    dots = xW = xS = gWt = gPt = None
    if dots_with is not None:
        dot_S = _flat_dot(dots_with, S) if S is not None else W.new_zeros(len(W))
        dots = torch.stack([_flat_dot(dots_with, W), dot_S], 1)
    if x is not None:
        xW, xS = xw_reference(x, W), xw_reference(x, S)
    if gt is not None:
        gWt = xwt_reference(gt[1], S, out=xwt_reference(gt[0], W), accumulate=True)
        gPt = xwt_reference(gt[3], Q, out=xwt_reference(gt[2], dots_with), accumulate=True)
    if out2 is not None:
        combine_reference(out2, S, e, A, G2, alpha)
    torch.mul(W, beta.reshape(-1, 1, 1), out=out)
    if S is not None:
        out.addcmul_(S, c.reshape(-1, 1, 1))
    out.baddbmm_(A.transpose(1, 2), G, alpha=alpha)
    return Reads(dots, xW, xS, gWt, gPt)


def _flat_dot(x: Tensor, y: Tensor) -> Tensor:
    """Per-batch ⟨x_b, y_b⟩ of two `[batch, r, c]` tensors. Large states: BLAS dots, no elementwise temporary (a
    [1, N] @ [N, 1] bmm is 20× slower). Small ones (under 64k elements each): one product and a sum beat a
    Python loop of dots."""
    if x[0].numel() < 1 << 16:
        return (x * y).sum((1, 2))
    return torch.stack([torch.dot(a.reshape(-1), b.reshape(-1)) for a, b in zip(x, y)])


# --- the kernels ---------------------------------------------------------------------------------------

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _why_not_buildable(flags: set[str]) -> Optional[str]:
    if os.environ.get("TITANS_KERNELS", "1") == "0":
        return "TITANS_KERNELS=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"no kernels for {platform.system()} {platform.machine()}"
    if not shutil.which(os.environ.get("CXX", "c++")):
        return "no C++ compiler (c++ or $CXX) on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed"
    return None


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (they are all alike), {} where there is none (macOS, Windows).
    The kernels' build reads its flags; `titans bench` names the machine from it."""
    fields: dict[str, str] = {}
    try:
        for line in path.read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _cpu_flags() -> set[str]:
    return set(cpu_info().get("flags", "").split())


def kernels():
    """The compiled module, or None (with one warning saying why) where it cannot be built. It always holds the
    chunk loop (`kernels/scan.cpp`); the state kernels only where the CPU has AVX-512 (`state_kernels`)."""
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build()
        return _loaded["module"]


def state_kernels():
    """The compiled module where it holds the AVX-512 state kernels, else None."""
    module = kernels()
    return module if module is not None and module.STATE_KERNELS else None


def _is_built(name: str) -> bool:
    """Whether torch's extension cache already holds the module `name` (then `load` only imports it)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # where `load` builds and caches

        return any(Path(_get_build_directory(name, verbose=False)).glob(f"{name}*.so"))
    except Exception:  # a private helper: if it moves, say nothing rather than fail
        return True


def _build():
    flags = _cpu_flags()
    reason = _why_not_buildable(flags)
    if reason is None:
        from torch.utils.cpp_extension import load

        # -march=native: the build is for this CPU; its flags are in the name so that a cache directory shared
        # with another machine never hands it a binary for other instructions.
        # The headers are in the name too: `load` rebuilds when a source changes, but does not look at headers.
        # So is the sources' folder: the build file names the sources by path, so two checkouts sharing one name
        # (git worktrees, a clone beside an install) would rebuild each other's module on every first use.
        key = (" ".join(sorted(flags)).encode() + str(_KERNELS.resolve()).encode()
               + b"".join(p.read_bytes() for p in _HEADERS))
        digest = hashlib.sha1(key).hexdigest()[:10]
        name = f"titans_state_ops_{digest}"
        if not _is_built(name):  # a minute of compiling should not look like a hang
            print("titans: building the CPU kernels (first use, about a minute; cached after)", file=sys.stderr,
                  flush=True)
        try:
            return load(name, [str(p) for p in _SOURCES],
                        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as err:  # a broken toolchain must not stop the library: the references remain
            lines = str(err).splitlines()
            first = next((line for line in lines if "error:" in line), lines[-1] if lines else type(err).__name__)
            reason = f"building {_KERNELS.name}/ failed: {first.strip()}"
    if os.environ.get("TITANS_KERNELS") == "1":
        raise RuntimeError(f"TITANS_KERNELS=1 but the state kernels are unavailable: {reason}")
    warnings.warn(f"titans: fused-memory state kernels unavailable ({reason}); using ATen matmuls", stacklevel=3)
    return None


def kernels_for(W: Tensor, rows: Tensor, *others: Optional[Tensor]):
    """The kernels if they serve these operands (W the state, `rows` the small operand, `others` the rest), else
    None: for the Python chunk loop and for `titans bench matmul`. Which shapes they serve is decided in one place,
    the compiled module's `kernel_serves` (the C++ loop asks it too); here only the other operands' dtype and
    device are added, which the C++ loop's operands share with W by construction."""
    module = state_kernels()
    if module is None or not module.kernel_serves(W, rows.shape[1]):
        return None
    for t in (rows, *others):
        if t is not None and (t.dtype is not torch.float32 or not t.is_cpu):
            return None
    return module


def xw(x: Tensor, W: Tensor, out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    """`out (+)= x W` for x `[batch, n, K]`, W `[batch, K, N]`."""
    ops = kernels_for(W, x, out)
    if ops is None or (out is not None and not out.is_contiguous()):
        return xw_reference(x, W, out, accumulate)
    if out is None:
        out = x.new_empty(x.shape[0], x.shape[1], W.shape[2])
    ops.xw(x, W, out, accumulate)
    return out


def xwt(g: Tensor, W: Tensor, out: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    """`out (+)= g Wᵀ` for g `[batch, n, N]`, W `[batch, K, N]`."""
    ops = kernels_for(W, g, out)
    if ops is None or (out is not None and not out.is_contiguous()) or g.stride(2) != 1:
        return xwt_reference(g, W, out, accumulate)
    if out is None:
        out = g.new_empty(g.shape[0], g.shape[1], W.shape[1])
    ops.xwt(g, W, out, accumulate)
    return out


# --- the three uses of `combine` in the fused scan, by name -----------------------------------------------------
# `combine` is one kernel with optional parts; each pass of the scan asks for a different set of them. These name
# the passes (fused.py and kernels/scan.cpp call these, not `combine`).


class Pair(NamedTuple):
    """A layer's two state matrices, or their gradients: the weights W and the momentum S, `[batch, K, N]` each."""

    W: Tensor
    S: Tensor


def update_state(new: Pair, state: Pair, decay: tuple[Tensor, Tensor, Tensor], a: Tensor, steps: Pair,
                 h: Tensor) -> Pair:
    """The forward pass's update of one layer over a chunk (DESIGN.md §2 step 4), into `new`:
    W' = β_n W + c_n S − aᵀ G_W and S' = e_n S − aᵀ G_S, with decay = (β_n, c_n, e_n) and steps = (G_W, G_S) the
    per-token coefficient rows (u_w ⊙ δ, u_m ⊙ δ). From the same pass over W and S it returns the queries' reads
    (h W, h S) of step 3, taken before the writes."""
    beta_n, c_n, e_n = decay
    reads = combine(new.W, state.W, beta_n, a, steps.W, -1.0, Momentum(state.S, c_n, new.S, e_n, steps.S), Wanted(x=h))
    return Pair(reads.xW, reads.xS)


class MomentumGrad(NamedTuple):
    """What `momentum_grad` reads beside ∂S⁰."""

    d_e: Tensor  # ⟨S, ∂S'⟩ [batch]: ∂e_n
    d_c: Tensor  # ⟨S, ∂W'⟩: ∂c_n
    a_dS: Tensor  # a ∂S' [batch, n, N]
    a_dW: Tensor  # a ∂W'
    a_grad: Tensor  # G_S ∂S'ᵀ + G_W ∂W'ᵀ [batch, n, K]: −∂a from the update
    h_grad: Tensor  # g_W Wᵀ + g_S Sᵀ: ∂h from the queries


def momentum_grad(out: Tensor, d_new: Pair, state: Pair, decay: tuple[Tensor, Tensor], h: Tensor, a: Tensor,
                  rows: tuple[Pair, Pair]) -> MomentumGrad:
    """The backward pass's one pass per layer over ∂W', ∂S', W and S (DESIGN.md §2, fused.py step 1–2), writing
    ∂S⁰ = e_n ∂S' + c_n ∂W' + hᵀ g_S into `out`, with decay = (c_n, e_n) and rows = (the update's coefficient
    rows (G_W, G_S), the queries' gradient rows (g_W, g_S) = (β ⊙ ∂r, c ⊙ ∂r)), and returning every other
    product of those four matrices that the chunk's backward pass needs."""
    c_n, e_n = decay
    update, query = rows
    reads = combine(out, d_new.S, e_n, h, query.S, 1.0, Momentum(d_new.W, c_n),
                    Wanted(dots_with=state.S, x=a, gt=(update.S, update.W, query.S, query.W), Q=state.W))
    return MomentumGrad(reads.dots[:, 0], reads.dots[:, 1], reads.xW, reads.xS, reads.gWt, reads.gPt)


def weight_grad(out: Tensor, d_new_W: Tensor, beta_n: Tensor, left: Rows, right: Rows, W: Tensor) -> Tensor:
    """The backward pass's ∂W⁰ = β_n ∂W' + Σ_j L_jᵀ R_j into `out` (its rank-n terms, as blocks of rows read in
    place), returning ∂β_n = ⟨W, ∂W'⟩ from the same pass."""
    return combine(out, d_new_W, beta_n, left, right, 1.0, wanted=Wanted(dots_with=W)).dots[:, 0]


def combine(out: Tensor, W: Tensor, beta: Tensor, A: Rows, G: Rows, alpha: float, momentum: Momentum = Momentum(),
            wanted: Wanted = Wanted()) -> Reads:
    """`out = β W (+ c S) + α Aᵀ G` with per-batch β, c (one value per batch element, any shape), A `[batch, n, K]`,
    G `[batch, n, N]`, each a tensor or a list of blocks of its rows (block j of A and of G with the same rows: the
    blocks are read in place, not concatenated); `out` may be W. With the momentum's term (`Momentum`: S, c), also
    `+ c S`, and with its `out2`, `out2 = e S + α Aᵀ G2` from the same reads of S (the forward pass's W' and S').

    Every other product of the inputs that a chunk needs is taken from the same pass over them (one read of each
    state matrix instead of one per product), and returned as `Reads`, all of the inputs before any write:
    with `dots_with` P, the dots ⟨P, W⟩ and ⟨P, S⟩ (0 without S; the backward pass's ∂β_n, ∂c_n, ∂e_n); with `x`
    `[batch, m, K]` (needs S), `x W` and `x S` (the queries at the chunk's start); with `gt` = (g_W, g_S, g_P, g_Q),
    each `[batch, m, N]`, and Q (needs S and P), `g_W Wᵀ + g_S Sᵀ` and `g_P Pᵀ + g_Q Qᵀ` (the backward pass's ∂a
    and ∂h). Those are what `wanted` asks for."""
    S, c, out2, e, G2 = momentum
    dots_with, x, gt, Q = wanted
    if x is not None and S is None:
        raise ValueError("combine: x needs S")
    if (gt is None) != (Q is None) or (gt is not None and (S is None or dots_with is None or len(gt) != 4)):
        raise ValueError("combine: gt (four tensors) and Q go together, and need S and dots_with")
    A_, G_, G2_ = ([t] if isinstance(t, Tensor) else list(t) if t is not None else None for t in (A, G, G2))
    gt_ = list(gt) if gt is not None else None
    states = (out, S, dots_with, out2, Q)
    ops = kernels_for(W, A_[0], *A_, *G_, *(G2_ or ()), *(gt_ or ()), x, beta, c, e, *states)
    if (ops is None or not all(t is None or t.is_contiguous() for t in states)
            or any(g.stride(2) != 1 for g in G_ + (G2_ or []) + (gt_ or []))
            or (gt_ is not None and out2 is not None)):
        return combine_reference(out, W, beta, A_, G_, alpha, Momentum(S, c, out2, e, G2_),
                                 Wanted(dots_with, x, gt_, Q))
    factors = [t.reshape(-1) if t is not None else None for t in (beta, c, e)]
    dots, xW, xS, gWt, gPt = ops.combine(out, W, factors[0], S, factors[1], A_, G_, float(alpha), dots_with, out2,
                                         factors[2], G2_, x, gt_, Q)
    return Reads(dots.to(W.dtype) if dots is not None else None, xW, xS, gWt, gPt)
