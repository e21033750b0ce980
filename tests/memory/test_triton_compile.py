"""The Triton kernels compiled for GPUs on the CPU: triton's compiler and ptxas for sm_90 (H100, H200) and sm_80
(A100), as a GPU would compile them (`compile_for_gpu.py`), with their resources read. The interpreter runs any
Python, so a kernel that would not launch on a GPU fails here. Apart from test_triton.py so that the suite's workers
(one file each) run the two side by side."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it first, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -c constraints.txt -e '.[gpu]')")

import triton  # noqa: E402

from titans.memory import triton_chunk  # noqa: E402

from .test_functional import channel_alpha, with_grad  # noqa: E402
from .test_triton import BOUNDS, inputs, on_device, outputs_and_grads  # noqa: E402

KERNELS = ("_forward_kernel", "_backward_kernel")
# Known and open (docs/bench/gpu/NOTES.md): the variants that spill, each held under a ceiling in bytes (stores and
# loads), keyed by (α per channel, chunk, GPU); every other variant spills nothing. At chunks of 64 an n × n matrix is
# 16 registers a thread. Measured with the tiles `choose_tiles` gives there (8 × 8 but for the scalar α on sm_90):
# every forward none; the backward with α per channel on sm_90 8 / 12, on sm_80 the scalar α 60 / 60 and α per
# channel 328 / 420 (at 16 × 16 tiles: 128 / 148, 280 / 396 and 452 / 668).
KNOWN_SPILLS = {(True, 64, 90): 12, (False, 64, 80): 60, (True, 64, 80): 420}
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
            options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "maxnreg") if key in kwargs}
            for name, value in self.signature.bind(*args, **kwargs).arguments.items():
                if self.signature.parameters[name].annotation in ("tl.constexpr", triton.language.constexpr):
                    signature[name] = "constexpr"
                    constexprs[name] = f"dtype:{value}" if isinstance(value, triton.language.dtype) else value
                else:
                    signature[name] = argument_type(value)
            record = dict(kernel=self.name, signature=signature, constexprs=constexprs, **options)
            if record not in self.launches:
                self.launches.append(record)
            return self.kernel[grid](*args, **kwargs, **options)
        return launch


def model_geometries(channels: bool = False) -> list[tuple[dict, dict, int]]:
    """(constexprs, launch options, GPU) of real models' memories as the kernels compile them: a depth-2 memory of
    expansion 4 on heads of 64 and 128 (the benchmark's 64 × 256 and 128 × 512) and a depth-4 one, at the default
    chunk of 16 and at 32, for sm_90 and for sm_80; and at the largest chunk, 64, for both. With α per channel (a
    variant of its own), the depth-2 memories at chunks of 16 and 64."""
    cases = [(64, 256, 2, 16, 90), (128, 512, 2, 16, 90), (64, 256, 4, 16, 90), (64, 256, 2, 32, 90),
             (64, 256, 2, 16, 80), (128, 512, 2, 16, 80), (64, 256, 2, 64, 90), (64, 256, 2, 64, 80)]
    if channels:
        cases = [(64, 256, 2, 16, 90), (128, 512, 2, 16, 90), (64, 256, 2, 64, 90), (64, 256, 2, 16, 80),
                 (64, 256, 2, 64, 80)]
    shapes = []
    for d, hidden, depth, chunk, arch in cases:
        geo = triton_chunk.Geometry(depth, d, hidden, d)
        tiles = triton_chunk.choose_tiles(geo, torch.float32, chunk, arch, channels)
        constexprs = dict(D_IN=d, HID=hidden, D_OUT=d, DEPTH=depth, CH=chunk, CHP=triton_chunk._pow2(chunk),
                          BK=tiles.BK, BN=tiles.BN)
        options = dict(num_warps=tiles.warps, num_stages=tiles.stages, maxnreg=tiles.maxnreg)
        shapes.append((constexprs, options, arch))
    return shapes


def compiled(launches: list[dict], folder: Path) -> list[dict]:
    """`compile_for_gpu.py`'s result for each launch, in order: the launches split between two processes (one a core,
    where there are two: the suite's other worker is often done before this test is), each with a fresh cache."""
    parts = max(1, min(2, os.cpu_count() or 1))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    processes = []
    for part in range(parts):
        path = folder / f"launches{part}.json"
        path.write_text(json.dumps(launches[part::parts]))
        processes.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("compile_for_gpu.py")), str(path)],
            env=dict(env, TRITON_CACHE_DIR=str(folder / f"cache{part}")), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    results: list[Optional[dict]] = [None] * len(launches)
    for part, process in enumerate(processes):
        out, err = process.communicate(timeout=1500)
        assert process.returncode == 0, err[-3000:]
        results[part::parts] = json.loads(out.splitlines()[-1])
    return results


@pytest.mark.slow
def test_the_kernels_compile_for_h100_and_a100(monkeypatch, tmp_path):
    """What the interpreter lets through, a GPU's compiler need not: a compiled kernel reads a module global only as a
    tl.constexpr, a constexpr is assigned once, a program must fit the chip's shared memory, and registers spilled
    in the chunk loop go through local memory on every chunk. So the kernels, as a model trains them (bf16 inputs,
    a float32 state, the default rule, at real memory sizes, with the paper's scalar α and with α per channel), are
    compiled by triton's compiler and ptxas for sm_90 (H100, H200) and sm_80 (A100): every variant asks for at most
    the chip's shared memory and spills no register, the backward at chunks of 64 on sm_90 included (it spilled 880
    bytes before its n × n matrices left the registers), except the chunk-64 variants in KNOWN_SPILLS, each held
    under its ceiling."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton has no CUDA backend here")
    launches = []
    for name in KERNELS:
        monkeypatch.setattr(triton_chunk, name, LaunchRecorder(name, getattr(triton_chunk, name), launches))
    for alpha in ("scalar", "channels"):
        trained = on_device(inputs(11, 2), torch.float32)
        if alpha == "channels":
            trained = channel_alpha(trained)
        trained[:3] = [t.bfloat16() for t in trained[:3]]
        outputs_and_grads(with_grad(trained), "triton", chunk_size=4, normalize_chunk=True, **BOUNDS)
    assert {(launch["kernel"], launch["constexprs"]["CHANNELS"]) for launch in launches} == \
        {(name, channels) for name in KERNELS for channels in (False, True)}
    to_compile = []
    for launch in launches:
        for shape, options, arch in model_geometries(launch["constexprs"]["CHANNELS"]):
            constexprs = {name: value for name, value in launch["constexprs"].items()
                          if name not in ("num_warps", "num_stages")}
            to_compile.append(dict(launch, constexprs={**constexprs, **shape}, arch=arch, **options))
    for launch, result in zip(to_compile, compiled(to_compile, tmp_path), strict=True):
        where = (launch["kernel"], launch["arch"], launch["constexprs"])
        assert "error" not in result, (where, result.get("error"))
        assert result["shared"] <= triton_chunk.SHARED_MEMORY_LIMIT[launch["arch"]], (where, result["shared"])
        ceiling = KNOWN_SPILLS.get((launch["constexprs"]["CHANNELS"], launch["constexprs"]["CH"], launch["arch"]), 0)
        assert result["spill_stores"] <= ceiling and result["spill_loads"] <= ceiling, (where, result)
