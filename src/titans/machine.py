"""The machine a measurement runs on, and measuring in a process of its own: what `bench/` and `experiments/`
share (neither imports the other). Every table says which machine made it (`describe_machine`); a point measured
in a fresh process (`run_isolated`, its module's main calling `limit_address_space`) has a peak resident memory of
its own (`rss_mib`) and fails cleanly ("out of memory") under an address-space cap instead of exhausting the machine.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Optional


def describe_machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU the numbers were measured on, e.g. "AMD EPYC (cpu family 26, model 2, AVX-512), 2 CPUs".

    The same code runs at half the speed on another VM of the same size (docs/PERFORMANCE.md, the seventh stop), so
    every table says which machine made it."""
    from .memory.state_ops import cpu_info

    fields = cpu_info(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    details = [f"{key} {fields[key]}" for key in ("cpu family", "model") if key in fields]
    if "avx512f" in fields.get("flags", "").split():
        details.append("AVX-512")
    described = f"{name} ({', '.join(details)})" if details else name
    return f"{described}, {os.cpu_count()} CPUs"


def rss_mib() -> float:
    """This process's resident memory now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_isolated(module: str, spec: dict, memory_cap_gib: float, timeout_s: float,
                 env: Optional[dict] = None) -> tuple[str, Optional[dict]]:
    """Run `python -m <module> '<spec as JSON>'` in a fresh process, its address space capped at memory_cap_gib
    (`limit_address_space`, which the module's main calls) and its time at timeout_s: ("ok", the JSON object its
    last stdout line printed), or (a status naming the failure, None)."""
    cmd = [sys.executable, "-m", module, json.dumps({**spec, "memory_cap_gib": memory_cap_gib})]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"timeout (> {timeout_s:.0f} s)", None
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        tail = lines[-1] if lines else f"exit code {out.returncode}"
        return ("out of memory" if "memory" in tail.lower() or out.returncode == -9 else f"error: {tail[:120]}"), None
    return "ok", json.loads(out.stdout.strip().splitlines()[-1])


def limit_address_space(spec: dict) -> dict:
    """In the isolated process: apply the spec's address-space cap and thread count; the spec without the cap.
    A run on a GPU gets no cap: the CUDA driver reserves far more address space than it uses, and the memory that
    matters there is the device's (its own out-of-memory error ends the point)."""
    spec = dict(spec)
    cap = int(spec.pop("memory_cap_gib") * 2**30)
    if not str(spec.get("device", "cpu")).startswith("cuda"):
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import torch

    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    return spec


def reference_available() -> bool:
    """Whether the reference package (`titans-pytorch`, the `compare` extra) is installed."""
    try:
        import titans_pytorch  # noqa: F401
    except ImportError:
        return False
    return True
