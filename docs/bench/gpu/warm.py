"""Compile the Triton kernels the benchmarks launch, each variant in a process of its own, all at once.

Triton compiles a kernel on its first launch and caches it on disk (TRITON_CACHE_DIR); the benchmarks' first steps
would otherwise compile one variant after another on one core. Each process here launches one variant (memory
shape, precision, forward or forward and backward) on a few tokens, as the benchmarks will; run.sh starts this in
the background while the CUDA tests run, and waits for it before the benchmarks.
"""

import os
import subprocess
import sys

# (head width, hidden width, precision, backward, α per channel): the layer benchmark's heads of 64 and 128 (expansion
# 4; the 125M model's memory is the 64-wide one) and its channel-wise α, and the precision benchmark's forwards.
VARIANTS = [(64, 256, "ieee", True, False), (128, 512, "ieee", True, False), (64, 256, "ieee", True, True),
            (64, 256, "tf32x3", False, False), (64, 256, "tf32", False, False)]

ONE = """
import os, sys, torch
from titans.memory import Gates, MemoryRule, parallel_memory
head, hidden, backward, channels = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
dev = torch.device("cuda")
q, k, v = (torch.nn.functional.normalize(torch.randn(1, 2, 40, head, device=dev), dim=-1) for _ in range(3))
theta, eta, alpha = (torch.rand(1, 2, 40, device=dev) * 0.1 for _ in range(3))
weights = (torch.randn(1, 2, head, hidden, device=dev) / head**0.5, torch.zeros(1, 2, hidden, head, device=dev))
tensors = [q, k, v, theta, eta, alpha]
if channels:  # one α per output column of each layer
    tensors[5] = tuple(torch.rand(1, 2, 40, w.shape[-1], device=dev) * 0.1 for w in weights)
if backward:
    tensors = [tuple(a.requires_grad_() for a in t) if isinstance(t, tuple) else t.requires_grad_() for t in tensors]
    weights = tuple(w.requires_grad_() for w in weights)
rule = MemoryRule.paper(max_grad_norm=4.0, max_state_norm=10.0, normalize_chunk=True)
y = parallel_memory(*tensors[:3], Gates(*tensors[3:]), weights, rule=rule, chunk_size=16, implementation="triton")[0]
if backward:
    y.square().sum().backward()
torch.cuda.synchronize()
print("compiled", head, hidden, os.environ.get("TITANS_TRITON_PRECISION"), backward, channels, flush=True)
"""

processes = []
for head, hidden, precision, backward, channels in VARIANTS:
    env = dict(os.environ, TITANS_TRITON_PRECISION=precision)
    processes.append(subprocess.Popen([sys.executable, "-c", ONE, str(head), str(hidden), "1" if backward else "0",
                                       "1" if channels else "0"], env=env))
sys.exit(max(p.wait() for p in processes))
