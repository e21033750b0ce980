"""Compiles the Triton memory kernels for an sm_90 GPU (H100, H200) with triton's own compiler; no GPU needed.

Run by tests/memory/test_triton.py in a process of its own, since the kernels must be imported without
TRITON_INTERPRET=1, which the test process sets. It reads a JSON list of launches. Each launch gives the kernel's
name, its argument types, its constexprs, and whether to run ptxas. For each launch it prints one JSON result: the
shared memory the kernel asks for, or the compiler's error. Shared memory is known before ptxas runs, so launches at
large shapes skip it (ptxas takes minutes there). Run it with TRITON_CACHE_DIR pointing at a fresh folder: a kernel
compiled without ptxas must not be cached for a GPU to load.
"""

import json
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

from titans.memory import triton_scan

SM_90 = GPUTarget("cuda", 90, 32)
DTYPES = {"fp32": tl.float32, "fp64": tl.float64, "bf16": tl.bfloat16}


def constexpr(value):
    """JSON carries a Triton dtype as "dtype:NAME"."""
    if isinstance(value, str) and value.startswith("dtype:"):
        return DTYPES[value[len("dtype:"):]]
    return value


def shared_memory(launch: dict) -> int:
    kernel = getattr(triton_scan, launch["kernel"])
    constexprs = {name: constexpr(value) for name, value in launch["constexprs"].items()}
    return triton.compile(ASTSource(kernel, launch["signature"], constexprs=constexprs), target=SM_90).metadata.shared


def main(path: str) -> None:
    with_ptxas = CUDABackend.make_cubin
    results = []
    for launch in json.load(open(path)):
        CUDABackend.make_cubin = with_ptxas if launch["ptxas"] else (lambda *args, **kwargs: b"")
        try:
            results.append({"shared": shared_memory(launch)})
        except Exception as err:  # the compiler's message is the result
            results.append({"error": f"{type(err).__name__}: {err}"[-3000:]})
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
