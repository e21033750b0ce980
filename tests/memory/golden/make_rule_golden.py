"""Writes `rule_golden.safetensors`: the memory's outputs and gradients before issue 45 (the rule defined once), for
`tests/memory/test_golden.py`, which holds every implementation to them exactly after the change.

Run at the commit the change started from (851c969), with that commit's tree first on the path:

    PYTHONPATH=<checkout of 851c969>/src python tests/memory/golden/make_rule_golden.py OUT.safetensors

MKL is put in its strict reproducible mode (MKL_CBWR=AUTO,STRICT, set here before torch is imported, and by
tests/conftest.py for the suite): by default its results depend on the alignment of the buffers, that is on what the
process allocated before, and differ in the last bit between two runs of the same computation in different processes.

It calls the API of that commit (loose rule arguments: `max_grad_norm=`, `normalize_chunk=`, ...), so it does not run
against the library after the change; the test calls the same cases through the new API. It stands alone (its helpers
are copies of the tests' of that commit, which it cannot import), so that it can be run again at that commit.
Everything is float64, one torch thread, fixed seeds, tiny shapes; the inputs are stored beside the results, so the test
reads the cases' inputs from the file instead of regenerating them. Each implementation that runs on a CPU is recorded:
the fused scan with its chunk loop in C++ and in Python, the autograd chunk path, the compiled chunk step, the token-by-
token reference, the one-token generation step, `NeuralMemory` (one call, a stream cut in pieces, token-by-token
generation, training-time κ counts) and whole `TitansLM` models of every memory variant (configs through
`build_memory`).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # before torch loads MKL (module docstring)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from titans import NeuralMemory, TitansConfig, TitansLM  # noqa: E402
from titans.memory import fused, parallel_memory, sequential_memory  # noqa: E402
from titans.memory.checks import Gates  # noqa: E402
from titans.memory.step import memory_token_step  # noqa: E402

DT = torch.float64

# Functional cases: (name, depth, seq, chunk, rule of that commit's API, extra parallel_memory options)
FUNCTIONAL = [
    ("paper", 2, 11, 4, {"activation": "gelu", "residual": False}, {}),
    ("stable_tight", 2, 11, 4, {"activation": "silu", "residual": True, "max_grad_norm": 0.5, "max_state_norm": 0.7,
                                "normalize_chunk": True, "hidden_step": 0.5}, {"checkpoint_chunks": 2}),
    ("linear_chunk1", 1, 6, 1, {"activation": "gelu", "residual": False, "max_grad_norm": 4.0,
                                "max_state_norm": 10.0, "normalize_chunk": True}, {}),
    ("depth3_chunk16", 3, 21, 16, {"activation": "gelu", "residual": False, "max_grad_norm": 4.0,
                                   "max_state_norm": 10.0, "normalize_chunk": True}, {}),
]

# NeuralMemory option sets (that commit's keyword arguments)
LAYERS = {
    "default": {},
    "surprise_gate": {"surprise_gate": True},
    "gated_deltanet": {"depth": 1, "momentum": False, "residual": False, "gradients": "token", "max_grad_norm": None,
                       "max_state_norm": None, "normalize_chunk": False, "max_momentum_step": None},
    "channel_forgetting": {"forgetting_channels": True},
    "constant_gates": {"gates": "constant", "init_theta": 0.5, "init_eta": 0.9, "init_alpha": 1e-3},
    "kappa_binds": {"max_momentum_step": 0.2, "init_eta": 0.6},
    "kappa_binds_surprise": {"max_momentum_step": 0.2, "surprise_gate": True},
    "paper": {"normalize_inputs": False, "max_grad_norm": None, "max_state_norm": None, "normalize_chunk": False,
              "max_momentum_step": None, "max_lr": 0.1},
    "depth3_hidden_step": {"depth": 3, "activation": "silu", "expansion": 2, "hidden_step": 0.3},
    "chunk_pooled_residual": {"gate_pooling": "chunk", "residual": True, "max_state_norm": 0.3},
}

# Whole models: config fields of that commit (flat)
MODELS = {
    "lmm": {"variant": "lmm"},
    "mac": {"variant": "mac"},
    "mag": {"variant": "mag", "memory_residual": True},
    "mal": {"variant": "mal", "memory_max_momentum_step": 0.2, "memory_init_eta": 0.6},
    "gated_deltanet": {"variant": "gated_deltanet"},
    "mac_options": {"variant": "mac", "memory_depth": 1, "surprise_gate": True, "memory_forgetting_channels": False,
                    "memory_hidden_step": 0.5, "memory_max_grad_norm": 0.5, "gate_pooling": "chunk",
                    "memory_activation": "silu", "chunk_size": 2},
}
MODEL_BASE = dict(vocab_size=32, dim=16, depth=1, heads=2, window=8, segment_len=8, n_persistent=2, chunk_size=4)


def functional_inputs(depth: int, seq: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    batch, heads, dim, hidden = 2, 2, 4, 8
    q = F.normalize(torch.randn(batch, heads, seq, dim, generator=g, dtype=DT), dim=-1)
    k = F.normalize(torch.randn(batch, heads, seq, dim, generator=g, dtype=DT), dim=-1)
    v = torch.randn(batch, heads, seq, dim, generator=g, dtype=DT)
    theta = 0.4 * torch.rand(batch, heads, seq, generator=g, dtype=DT)
    eta = 0.8 * torch.rand(batch, heads, seq, generator=g, dtype=DT)
    alpha = 0.2 * torch.rand(batch, heads, seq, generator=g, dtype=DT)
    widths = [dim] + [hidden] * (depth - 1) + [dim]
    weights = tuple(torch.randn(batch, heads, a, b, generator=g, dtype=DT) / a**0.5 for a, b in zip(widths, widths[1:]))
    momentum = tuple(0.1 * torch.randn(w.shape, generator=g, dtype=DT) for w in weights)
    return [q, k, v, theta, eta, alpha, weights, momentum]


def flat(args) -> list:
    return [t for a in args for t in (a if isinstance(a, tuple) else (a,))]


def with_grad(args) -> list:
    return [tuple(t.detach().clone().requires_grad_() for t in a) if isinstance(a, tuple)
            else a.detach().clone().requires_grad_() for a in args]


def probe_loss(outs: list) -> torch.Tensor:
    """A loss that weighs every output element differently (fixed seed), so every gradient term shows."""
    g = torch.Generator().manual_seed(1)
    return sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)


def record_functional(store: dict) -> None:
    for case, (name, depth, seq, chunk, rule, extra) in enumerate(FUNCTIONAL):
        args = functional_inputs(depth, seq, seed=10 + case)
        for i, t in enumerate(flat(args)):
            store[f"functional/{name}/input/{i}"] = t
        runs = {
            "fused": lambda a: parallel_memory(*a, chunk_size=chunk, implementation="fused", **rule, **extra),
            "autograd": lambda a: parallel_memory(*a, chunk_size=chunk, implementation="autograd", **rule, **extra),
            "reference": lambda a: sequential_memory(*a, chunk_size=chunk, **rule),
        }
        if name == "paper":
            runs["compile"] = lambda a: parallel_memory(*a, chunk_size=chunk, implementation="compile", **rule)
        for impl, run in runs.items():
            for native in ((True, False) if impl == "fused" else (True,)):
                fused.NATIVE = native
                a = with_grad(args)
                y, W, S = run(a)
                outs = [y, *W, *S]
                grads = torch.autograd.grad(probe_loss(outs), flat(a))
                label = impl if native else "fused_python"
                for i, t in enumerate([*outs, *grads]):
                    store[f"functional/{name}/{label}/{i}"] = t.detach()
        fused.NATIVE = True
        # the one-token step: each token of the first chunk (the chunk_end one returns the state after the chunk)
        q, k, v, theta, eta, alpha, weights, momentum = args
        n = min(chunk, seq)
        for t in range(1, n + 1):
            gates = Gates(theta[:, :, :t], eta[:, :, :t], alpha[:, :, :t], None)
            y, W, S = memory_token_step(q[:, :, t - 1:t], k[:, :, :t], v[:, :, :t], gates, weights, momentum,
                                        chunk_end=t == n, **rule)
            kept = [y, *W, *S] if t == n else [y]  # mid-chunk the state is the chunk's start, unchanged
            for i, x in enumerate(kept):
                store[f"functional/{name}/step{t}/{i}"] = x


def make_memory(**options) -> NeuralMemory:
    torch.manual_seed(0)
    memory = NeuralMemory(16, heads=2, chunk_size=4, **options).to(DT)
    with torch.no_grad():
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


def record_layers(store: dict) -> None:
    x = torch.randn(2, 23, 16, generator=torch.Generator().manual_seed(5), dtype=DT)
    store["layer/input"] = x
    for name, options in LAYERS.items():
        memory = make_memory(**options)
        memory.train()
        y, state = memory(x)
        loss = probe_loss([y, *state.weights, *state.momentum])
        params = dict(memory.named_parameters())
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for i, t in enumerate([y, *state.weights, *state.momentum]):
            store[f"layer/{name}/call/{i}"] = t.detach()
        for (pname, p), g in zip(params.items(), grads):
            if g is not None:
                store[f"layer/{name}/grad/{pname}"] = g
        lowered, bounded = memory.momentum_bound_record()
        store[f"layer/{name}/bound_record"] = torch.tensor([lowered, bounded], dtype=torch.int64)
        memory.eval()
        with torch.no_grad():
            y_pieces, state = run_in_pieces(memory, x, [3, 4, 11, 12])
            store[f"layer/{name}/pieces"] = y_pieces
            y_tokens, state = run_in_pieces(memory, x, list(range(1, 23)))  # the one-token step where it serves
            store[f"layer/{name}/tokens"] = y_tokens
            for i, t in enumerate([*state.weights, *state.momentum]):
                store[f"layer/{name}/tokens_state/{i}"] = t


def record_models(store: dict) -> None:
    tokens = torch.randint(0, 32, (2, 21), generator=torch.Generator().manual_seed(7))
    store["model/tokens"] = tokens
    for name, fields in MODELS.items():
        torch.manual_seed(0)
        model = TitansLM(TitansConfig(**{**MODEL_BASE, **fields})).to(DT)
        logits, _ = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        params = dict(model.named_parameters())
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        store[f"model/{name}/logits"] = logits.detach()
        for (pname, p), g in zip(params.items(), grads):
            if g is not None:
                store[f"model/{name}/grad/{pname}"] = g


def main(out: str) -> None:
    torch.set_num_threads(1)
    store: dict = {}
    record_functional(store)
    record_layers(store)
    record_models(store)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__import__("titans").__file__).parent).stdout.strip()
    meta = {"cpu": cpu, "avx512": str("avx512f" in flags), "torch": torch.__version__, "commit": commit,
            "python": sys.version.split()[0], "mkl_cbwr": os.environ["MKL_CBWR"]}
    save_file({k: v.detach().clone().contiguous() for k, v in store.items()}, out, metadata=meta)
    print(f"wrote {len(store)} tensors to {out}: {meta}")


if __name__ == "__main__":
    main(sys.argv[1])
