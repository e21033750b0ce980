"""Compiles the Triton memory kernels for NVIDIA GPUs with triton's own compiler and ptxas; no GPU needed.

Run by tests/memory/test_triton.py in a process of its own, since the kernels must be imported without
TRITON_INTERPRET=1, which the test process sets. It reads a JSON list of launches; each gives the kernel's name, its
argument types, its constexprs, its warps and the GPU's compute capability (90: H100 and H200, 80: A100). For each
launch it prints one JSON result: the shared memory the kernel asks for, and ptxas's register and spill report
(`ptxas -v`), or the compiler's error. Run it with TRITON_CACHE_DIR pointing at a fresh folder: the kernels are
compiled without a driver and must not be cached for a GPU to load.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas
from triton.compiler import ASTSource

from titans.memory import triton_chunk

DTYPES = {"fp32": tl.float32, "fp64": tl.float64, "bf16": tl.bfloat16}


def constexpr(value):
    """JSON carries a Triton dtype as "dtype:NAME"."""
    if isinstance(value, str) and value.startswith("dtype:"):
        return DTYPES[value[len("dtype:"):]]
    return value


def ptx_of(launch: dict) -> tuple[str, int]:
    """The kernel's PTX for the launch's GPU, and the shared memory it asks for (known before ptxas runs)."""
    kernel = getattr(triton_chunk, launch["kernel"])
    constexprs = {name: constexpr(value) for name, value in launch["constexprs"].items()}
    source = ASTSource(kernel, launch["signature"], constexprs=constexprs)
    ptx = {}

    def keep_ptx(self, src, metadata, opt, capability):  # stands in for ptxas, run below with -v
        ptx["text"] = src
        return b""

    CUDABackend.make_cubin = keep_ptx
    compiled = triton.compile(source, target=GPUTarget("cuda", launch["arch"], 32),
                              options=dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"],
                                           **({"maxnreg": launch["maxnreg"]} if launch.get("maxnreg") else {})))
    return ptx["text"], compiled.metadata.shared


def ptxas_report(ptx: str, arch: int) -> dict:
    """ptxas -v on the PTX for sm_`arch` (sm_90a on Hopper, as triton builds it): registers and spilled bytes."""
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}", str(path),
                               "-o", str(path.with_suffix(".cubin"))], capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode:
        raise RuntimeError(f"ptxas failed: {log[-2000:]}")
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_stores": int(spills.group(1)) if spills else 0, "spill_loads": int(spills.group(2)) if spills else 0}


def main(path: str) -> None:
    results = []
    for launch in json.load(open(path)):
        try:
            ptx, shared = ptx_of(launch)
            results.append({"shared": shared, **ptxas_report(ptx, launch["arch"])})
        except Exception as err:  # the compiler's message is the result
            results.append({"error": f"{type(err).__name__}: {err}"[-3000:]})
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
