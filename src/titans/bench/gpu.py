"""The GPU benchmarks (`titans bench gpu`): one process, one JSON per benchmark, the GPU and its software named.

What runs, each point timed with CUDA events after warm-up steps that also compile the Triton kernels:
- `matmul`: the GPU's own matrix-product rate (bf16, TF32 and IEEE float32, 8192³), the ceiling the memory's kernels
  are read against;
- `layer`: the memory layer (NeuralMemory, depth 2, expansion 4, chunk 16, the library's default rule) forward and
  backward under bf16 autocast, beside a causal SDPA (FlashAttention) layer of the same width and, where installed,
  titans-pytorch's NeuralMemory at the same configuration; tokens/s, peak GPU memory, and the kernels' achieved
  FLOP/s (`kernel_flops`) as a share of the bf16 and float32 matmul rates;
- `model`: a 125M model (dim 768, 12 blocks, 12 heads) of every variant, a training step (forward, backward,
  AdamW) under bf16 autocast at 4K and 16K tokens per sequence: tokens/s and peak memory, the transformer's beside;
- `decode`: tokens/s decoding after a long context (32K tokens) at batch 1 and 16, a Titans variant against the
  transformer's KV cache, each one-token step of either replayed from a CUDA graph (`StaticDecoder`; the JSON's
  `path` says "graph", or "static" where the same step ran eagerly, off a GPU);
- `precision`: the memory's outputs and end state in float32 under each of the kernels' precisions against float64
  at 4K and 32K tokens.

Each benchmark writes its JSON as it finishes (a benchmark cut short by the caller's time limit leaves the others),
and `summary` prints the table the GPU script ends with. `--quick` runs every benchmark at toy sizes, so that the
whole script is dry-run on a CPU (the Triton kernels under TRITON_INTERPRET=1 there).
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..memory import Gates, MemoryRule, NeuralMemory, parallel_memory
from ..memory.triton_chunk import PRECISIONS, Geometry
from ..models import StaticDecoder, TitansConfig, TitansLM

# The configurations: (dim, heads) of the memory layer (heads of 64 and of 128), sequence lengths with the
# batch that keeps the tokens per step near 32K, the 125M model.
LAYER_WIDTHS = ((1024, 16), (768, 12), (2048, 16))
LAYER_LENGTHS = ((4096, 8), (16384, 2))
MODEL = dict(vocab_size=32000, dim=768, depth=12, heads=12, window=512, segment_len=512, n_persistent=16)
MODEL_LENGTHS = ((4096, 4), (16384, 1))
DECODE = dict(context=32768, batches=(1, 16), new_tokens=64, variant="lmm")
PRECISION_LENGTHS = (4096, 32768)

QUICK_LAYER_WIDTHS = ((32, 2),)
QUICK_LAYER_LENGTHS = ((64, 2),)
QUICK_MODEL = dict(vocab_size=64, dim=32, depth=2, heads=2, window=16, segment_len=16, n_persistent=2)
QUICK_MODEL_LENGTHS = ((64, 2),)
QUICK_DECODE = dict(context=48, batches=(1, 2), new_tokens=4, variant="lmm")
QUICK_PRECISION_LENGTHS = (48,)


def environment(device: torch.device) -> dict[str, Any]:
    """The machine a JSON was measured on: the GPU, its driver, torch, triton and CUDA."""
    import triton

    env: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                           "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, multiprocessors=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1),
                   l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["gpu"] = None
    return env


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """The fastest of `repeats` calls of fn in seconds, after `warmup` calls (which also compile): CUDA events on a
    GPU, the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return min(times)


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> Optional[float]:
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None


def guarded(point: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """fn's results in `point`, or its status where the GPU ran out of memory or the call failed."""
    try:
        point.update(fn())
        point["status"] = "ok"
    except torch.OutOfMemoryError:
        point["status"] = "out of memory"
    except (RuntimeError, ValueError, ImportError) as err:
        point["status"] = f"error: {' '.join(str(err).split())[:300]}"
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return point


# --- the matmul ceiling -------------------------------------------------------------------------------------------


def matmul(device: torch.device, size: int, repeats: int) -> dict[str, Any]:
    """TFLOP/s of a size³ matrix product in bf16, in float32 through TF32 tensor cores, and in IEEE float32."""
    out = {}
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                              ("fp32", torch.float32, False)):
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        keep = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            seconds = timed(lambda: a @ b, device, 2, repeats)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = keep
        out[f"{name}_tflops"] = round(2 * size**3 / seconds / 1e12, 2)
    return out


# --- the memory layer ---------------------------------------------------------------------------------------------


class CausalAttention(nn.Module):
    """The attention layer the memory is read against: q, k, v and output projections around a causal SDPA
    (FlashAttention on a GPU), the width and heads of the memory layer."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2)), None


def reference_memory(dim: int, heads: int, chunk_size: int):
    """titans-pytorch's NeuralMemory (the `compare` extra) at our layer's configuration."""
    from titans_pytorch import NeuralMemory as Reference

    return Reference(dim=dim, chunk_size=chunk_size, heads=heads,
                     default_model_kwargs=dict(depth=2, expansion_factor=4.0))


def kernel_flops(geo: Geometry, chunk_size: int, replay: bool) -> float:
    """The floating-point operations of the Triton kernels' products per token and head, forward and backward (each
    product 2 M N K): per layer of P = d_in · d_out weights, the forward's keys, δ recursion, queries (h W⁰, h S⁰)
    and update (W', S') are 2P each (6 + 1 below the first layer), the backward's recomputation, update gradient,
    queries' gradient, δ recursion and keys 2P × (13 + 3 below the first layer); with recomputation groups the
    forward runs twice. Counted at the rows the kernels compute (a chunk's rows padded to a power of two, at least
    16), per token of the chunk. The n × n algebra (O(n² d) per chunk) is left out: under 5% at n = 16."""
    total = 0.0
    for i, (a, b) in enumerate(geo.layer_shapes()):
        deep = 1 if i > 0 else 0
        total += 2 * a * b * ((6 + deep) * (2 if replay else 1) + 13 + 3 * deep)
    return total * max(16, 1 << (chunk_size - 1).bit_length()) / chunk_size


def layer_point(kind: str, dim: int, heads: int, seq: int, batch: int, device: torch.device, warmup: int,
                repeats: int) -> dict[str, Any]:
    """Forward+backward tokens/s of one layer under bf16 autocast, and its peak GPU memory."""
    point: dict[str, Any] = dict(kind=kind, dim=dim, heads=heads, seq=seq, batch=batch)

    def run() -> dict[str, Any]:
        torch.manual_seed(0)
        if kind in ("titans", "titans-channels"):  # the paper's scalar α, or α per output column of each layer
            rule = MemoryRule(forgetting_channels=kind == "titans-channels")
            layer = NeuralMemory(dim, heads=heads, depth=2, expansion=4, chunk_size=16, rule=rule)
        elif kind == "sdpa":
            layer = CausalAttention(dim, heads)
        else:
            layer = reference_memory(dim, heads, 16)
        layer = layer.to(device)
        x = torch.randn(batch, seq, dim, device=device)
        peak_reset(device)

        def step():
            layer.zero_grad(set_to_none=True)
            with autocast(device):
                y = layer(x)[0]
            y.float().square().mean().backward()

        seconds = timed(step, device, warmup, repeats)
        result = dict(seconds=seconds, fwd_bwd_tok_s=round(batch * seq / seconds), peak_mib=peak_mib(device))
        if kind in ("titans", "titans-channels"):
            head = dim // heads
            geo = Geometry(2, head, head * 4, head)
            groups = seq // 16 > 64  # NeuralMemory recomputes groups of chunks beyond 64 chunks
            flops = kernel_flops(geo, 16, groups) * heads * batch * seq
            result.update(kernel_tflops=round(flops / seconds / 1e12, 2))
        return result

    return guarded(point, run)


def layers(device: torch.device, quick: bool, warmup: int, repeats: int) -> list[dict[str, Any]]:
    widths = QUICK_LAYER_WIDTHS if quick else LAYER_WIDTHS
    lengths = QUICK_LAYER_LENGTHS if quick else LAYER_LENGTHS
    kinds = ["titans", "titans-channels", "sdpa"]
    try:
        import titans_pytorch  # noqa: F401
        kinds.append("titans-pytorch")
    except ImportError:
        pass
    points = []
    for dim, heads in widths:
        for seq, batch in lengths:
            for kind in kinds:
                if kind in ("titans-pytorch", "titans-channels") and (dim, heads) != widths[0]:
                    continue  # the reference and α per channel at the main width only: the time is short
                if kind == "titans-channels" and seq != lengths[0][0]:
                    continue
                point = layer_point(kind, dim, heads, seq, batch, device, warmup, repeats)
                while kind == "titans-pytorch" and point["status"] == "out of memory" and point["batch"] > 1:
                    # the largest batch it fits, as the issue asks ("or the largest it fits; say which")
                    point = layer_point(kind, dim, heads, seq, point["batch"] // 2, device, 1, 1)
                points.append(point)
                print(describe(points[-1]), flush=True)
    return points


# --- the 125M model -----------------------------------------------------------------------------------------------


def model_point(variant: str, model: dict[str, Any], seq: int, batch: int, device: torch.device, warmup: int,
                repeats: int) -> dict[str, Any]:
    """A training step (forward, backward, AdamW) of one variant under bf16 autocast: tokens/s and peak memory."""
    point: dict[str, Any] = dict(kind="model", variant=variant, seq=seq, batch=batch)

    def run() -> dict[str, Any]:
        torch.manual_seed(0)
        lm = TitansLM(TitansConfig(variant=variant, **model)).to(device)
        optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=device.type == "cuda")
        tokens = torch.randint(0, model["vocab_size"], (batch, seq + 1), device=device)
        peak_reset(device)

        def step():
            optimizer.zero_grad(set_to_none=True)
            with autocast(device):
                logits = lm(tokens[:, :-1])[0]
            F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()

        seconds = timed(step, device, warmup, repeats)
        return dict(parameters=sum(p.numel() for p in lm.parameters()), seconds=seconds,
                    train_tok_s=round(batch * seq / seconds), peak_mib=peak_mib(device))

    return guarded(point, run)


def models(device: torch.device, quick: bool, warmup: int, repeats: int) -> list[dict[str, Any]]:
    model = QUICK_MODEL if quick else MODEL
    points = []
    for seq, batch in QUICK_MODEL_LENGTHS if quick else MODEL_LENGTHS:
        for variant in ("transformer", "lmm", "mac", "mag", "mal"):
            points.append(model_point(variant, model, seq, batch, device, warmup, repeats))
            print(describe(points[-1]), flush=True)
    return points


# --- decoding after a long context --------------------------------------------------------------------------------


def decode_point(variant: str, model: dict[str, Any], context: int, batch: int, new_tokens: int,
                 device: torch.device) -> dict[str, Any]:
    """Greedy tokens/s after reading a `context`-token prompt (untimed), bf16 weights (the memory's state float32).

    Every variant (the transformer's KV cache too) decodes through `StaticDecoder`, its one-token step over a state of
    fixed shape: on a GPU replayed from CUDA graphs (path "graph"), elsewhere run eagerly (path "static"). The
    warm-up steps bring every phase (chunk position, MAC's segment end) round twice, so that every graph is captured
    before the timed steps; the timed `new_tokens` steps are the best of two runs, each step's argmax fed back on the
    device."""
    graphs = device.type == "cuda"
    point: dict[str, Any] = dict(kind="decode", variant=variant, context=context, batch=batch,
                                 path="graph" if graphs else "static")

    def run() -> dict[str, Any]:
        torch.manual_seed(0)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        config = TitansConfig(variant=variant, **model)
        lm = TitansLM(config).to(device=device, dtype=dtype).eval()
        prompt = torch.randint(0, model["vocab_size"], (batch, context), device=device)
        chunk = config.memory.chunk_size  # the phases repeat every chunk, MAC's every lcm(chunk, segment)
        warm = 2 * (math.lcm(chunk, config.attention.segment_len) if variant == "mac" else chunk)
        peak_reset(device)
        with torch.no_grad():
            # the context's state without its logits (at 32K × batch 16 × 32K vocabulary they would take 33 GB)
            state = lm.backbone(lm.embed(prompt[:, :-1]))[1]
            decoder = StaticDecoder(lm, state, warm + 2 * new_tokens, graphs=graphs)
            del state  # the decoder holds its own copy
            token = prompt[:, -1:]

            def decode(steps: int) -> None:
                nonlocal token
                for _ in range(steps):
                    token = decoder.step(token).argmax(-1, keepdim=True)

            decode(warm)
            seconds = timed(lambda: decode(new_tokens), device, 0, 2)
        return dict(seconds=seconds, decode_tok_s=round(batch * new_tokens / seconds), peak_mib=peak_mib(device),
                    graphs=decoder.captured)

    return guarded(point, run)


def decodes(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    model, spec = (QUICK_MODEL, QUICK_DECODE) if quick else (MODEL, DECODE)
    points = []
    for batch in spec["batches"]:
        for variant in ("transformer", spec["variant"]):
            points.append(decode_point(variant, model, spec["context"], batch, spec["new_tokens"], device))
            print(describe(points[-1]), flush=True)
    return points


# --- precision against float64 ------------------------------------------------------------------------------------


def precision_point(seq: int, heads: int, head: int, device: torch.device, precision: str) -> dict[str, Any]:
    """The relative error (max |x − x64| / max |x64|) of y and the end weights of the Triton kernels in float32 at
    `precision` against the autograd path in float64, on the same inputs (the default rule, depth 2, chunk 16)."""
    point: dict[str, Any] = dict(kind="precision", seq=seq, heads=heads, head=head, precision=precision)

    def run() -> dict[str, Any]:
        import os

        g = torch.Generator(device="cpu").manual_seed(0)

        def rand(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(device)

        q, k = (F.normalize(rand(1, heads, seq, head), dim=-1) for _ in range(2))
        v = F.normalize(rand(1, heads, seq, head), dim=-1)
        theta = torch.sigmoid(rand(1, heads, seq) - 1.5)
        eta, alpha = torch.sigmoid(rand(1, heads, seq)), torch.sigmoid(rand(1, heads, seq) - 9.0)
        weights = (rand(1, heads, head, 4 * head, scale=head**-0.5), rand(1, heads, 4 * head, head, scale=0.02))
        # the library's bounds and normalised chunk step on these gates as given (no κ: the rule's other fields)
        rule = dict(chunk_size=16, rule=MemoryRule.paper(max_grad_norm=4.0, max_state_norm=10.0, normalize_chunk=True))
        with torch.no_grad():
            y64, w64, _ = parallel_memory(q, k, v, Gates(theta, eta, alpha), weights, implementation="autograd", **rule)
            keep = os.environ.get("TITANS_TRITON_PRECISION")
            os.environ["TITANS_TRITON_PRECISION"] = precision
            try:
                q32, k32, v32, *gates32 = (t.float() for t in (q, k, v, theta, eta, alpha))
                y32, w32, _ = parallel_memory(q32, k32, v32, Gates(*gates32), tuple(w.float() for w in weights),
                                              implementation="triton", **rule)
            finally:
                os.environ.pop("TITANS_TRITON_PRECISION") if keep is None else os.environ.update(
                    TITANS_TRITON_PRECISION=keep)

        def relative(x, ref):
            return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))

        return dict(y_error=relative(y32, y64), weights_error=max(relative(a, b) for a, b in zip(w32, w64)))

    return guarded(point, run)


def precisions(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    points = []
    heads, head = (2, 8) if quick else (4, 64)
    for seq in QUICK_PRECISION_LENGTHS if quick else PRECISION_LENGTHS:
        for name in PRECISIONS:
            points.append(precision_point(seq, heads, head, device, name))
            print(describe(points[-1]), flush=True)
    return points


# --- the run and its table ----------------------------------------------------------------------------------------


def describe(point: dict[str, Any]) -> str:
    keys = [k for k in point if k not in ("status",)]
    return " ".join(f"{k}={point[k]}" for k in keys) + f" [{point.get('status')}]"


BENCHMARKS = ("matmul", "layer", "model", "decode", "precision")


def run(out: Path, only: tuple[str, ...] = BENCHMARKS, quick: bool = False, device: Optional[str] = None,
        command: str = "") -> dict[str, Path]:
    """Every benchmark in `only`, each writing out/<name>.json when it finishes."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out.mkdir(parents=True, exist_ok=True)
    env = environment(dev)
    warmup, repeats = (1, 1) if quick else (2, 3)
    written = {}
    for name in only:
        started = time.perf_counter()
        if name == "matmul":
            rows: Any = guarded({}, lambda: matmul(dev, 256 if quick else 8192, 1 if quick else 5))
        elif name == "layer":
            rows = layers(dev, quick, warmup, repeats)
        elif name == "model":
            rows = models(dev, quick, warmup, repeats)
        elif name == "decode":
            rows = decodes(dev, quick)
        else:
            rows = precisions(dev, quick)
        path = out / f"{name}.json"
        path.write_text(json.dumps({"benchmark": name, "command": command, "environment": env, "quick": quick,
                                    "seconds": round(time.perf_counter() - started, 1), "results": rows}, indent=1))
        written[name] = path
        print(f"wrote {path} ({time.perf_counter() - started:.0f} s)", flush=True)
    return written


def _rate(points: list[dict[str, Any]], key: str, **match: Any) -> Optional[float]:
    for p in points:
        if p.get("status") == "ok" and all(p.get(k) == v for k, v in match.items()):
            return p.get(key)
    return None


def summary(folder: Path) -> str:
    """The short table the GPU script prints last, from the JSONs in `folder`: the issue's ratios."""
    data = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json") if p.stem in BENCHMARKS}
    lines = []
    env = next(iter(data.values()), {}).get("environment", {})
    lines.append(f"GPU {env.get('gpu')} driver {env.get('driver')} torch {env.get('torch')} triton "
                 f"{env.get('triton')}")
    mm = data.get("matmul", {}).get("results", {})
    if mm:
        lines.append(f"matmul: bf16 {mm.get('bf16_tflops')} / tf32 {mm.get('tf32_tflops')} / fp32 "
                     f"{mm.get('fp32_tflops')} TFLOP/s")
    layer = data.get("layer", {}).get("results", [])
    for dim, heads, seq in sorted({(p["dim"], p["heads"], p["seq"]) for p in layer}):
        ours = _rate(layer, "fwd_bwd_tok_s", kind="titans", dim=dim, seq=seq)
        sdpa = _rate(layer, "fwd_bwd_tok_s", kind="sdpa", dim=dim, seq=seq)
        ref = _rate(layer, "fwd_bwd_tok_s", kind="titans-pytorch", dim=dim, seq=seq)
        ref_batch = _rate(layer, "batch", kind="titans-pytorch", dim=dim, seq=seq)
        tflops = _rate(layer, "kernel_tflops", kind="titans", dim=dim, seq=seq)
        ratio = f"{ours / sdpa:.2f}x SDPA" if ours and sdpa else "no ratio"
        vs_ref = f", {ours / ref:.1f}x titans-pytorch (batch {ref_batch})" if ours and ref else ""
        channels = _rate(layer, "fwd_bwd_tok_s", kind="titans-channels", dim=dim, seq=seq)
        vs_ref += f", α per channel {channels / ours:.2f}x the scalar α's tok/s" if ours and channels else ""
        share = f", kernels {tflops} TFLOP/s = {tflops / mm['fp32_tflops']:.0%} of fp32 matmul" if tflops and mm.get(
            "fp32_tflops") else ""
        lines.append(f"layer dim {dim} heads {heads} T {seq}: titans {ours} tok/s, SDPA {sdpa}: {ratio}{vs_ref}"
                     f"{share}")
    model = data.get("model", {}).get("results", [])
    for seq in sorted({p["seq"] for p in model}):
        base = _rate(model, "train_tok_s", variant="transformer", seq=seq)
        cells = []
        for variant in ("lmm", "mac", "mag", "mal"):
            rate = _rate(model, "train_tok_s", variant=variant, seq=seq)
            peak = _rate(model, "peak_mib", variant=variant, seq=seq)
            cells.append(f"{variant} {rate / base:.2f}x ({peak} MiB)" if rate and base else f"{variant} -")
        lines.append(f"model T {seq}: transformer {base} tok/s; " + ", ".join(cells))
    decode = data.get("decode", {}).get("results", [])
    for batch in sorted({p["batch"] for p in decode}):
        base = _rate(decode, "decode_tok_s", variant="transformer", batch=batch)
        titan = next((p for p in decode if p["variant"] != "transformer" and p["batch"] == batch), None)
        rate = titan.get("decode_tok_s") if titan and titan.get("status") == "ok" else None
        ratio = f"{rate / base:.2f}x" if rate and base else "no ratio"
        path = titan.get("path", "dynamic") if titan else "-"
        lines.append(f"decode batch {batch} ({path}): transformer {base} tok/s, {titan and titan['variant']} {rate}: "
                     f"{ratio}")
    for p in data.get("precision", {}).get("results", []):
        if p.get("status") == "ok":
            lines.append(f"precision {p['precision']} T {p['seq']}: y {p['y_error']:.1e}, W {p['weights_error']:.1e}")
    return "\n".join(lines)

