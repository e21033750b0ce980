"""Benchmarks, run as commands (`titans bench ...`), never as timed tests."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Optional

import typer

bench_app = typer.Typer(help="Throughput and memory benchmarks.", no_args_is_help=True)


@bench_app.callback()
def _group() -> None:
    """Throughput and memory benchmarks (commands, not tests)."""


def describe_machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU the numbers were measured on, e.g. "AMD EPYC (cpu family 26, model 2, AVX-512), 2 CPUs".

    The same code runs at half the speed on another VM of the same size (DESIGN.md §2, seventh stop), so every
    table says which machine made it."""
    from ..memory.state_ops import cpu_info

    fields = cpu_info(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    details = [f"{key} {fields[key]}" for key in ("cpu family", "model") if key in fields]
    if "avx512f" in fields.get("flags", "").split():
        details.append("AVX-512")
    described = f"{name} ({', '.join(details)})" if details else name
    return f"{described}, {os.cpu_count()} CPUs"


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{name} must be positive integers, got {text!r}")
    return values


@bench_app.command("memory")
def memory(
    lengths: str = typer.Option("512,1024,2048,4096,8192,16384", help="Sequence lengths, comma-separated."),
    batch: int = typer.Option(4, min=1),
    dim: int = typer.Option(256, min=1),
    heads: int = typer.Option(1, min=1),
    depth: int = typer.Option(2, min=1),
    expansion: int = typer.Option(4, min=1),
    chunk_size: int = typer.Option(16, min=1),
    repeats: int = typer.Option(2, min=1, help="Timed iterations per point (the best is reported)."),
    rounds: int = typer.Option(1, min=1, help="Runs of each point, ours and the reference alternating, so that both "
                                              "see the same phases of a noisy machine; the best of each is reported."),
    warmup: int = typer.Option(2, min=0, help="Untimed iterations first (allocator and caches reach steady state)."),
    reference: bool = typer.Option(True, help="Also measure titans-pytorch==0.5.5 when installed."),
    reference_lengths: Optional[str] = typer.Option(
        "512,1024,2048,8192", help="Lengths at which to run the reference (it is slow and memory hungry)."
    ),
    memory_cap_gib: float = typer.Option(20.0, help="Address-space cap per point; above it a point reports OOM."),
    timeout_s: float = typer.Option(900.0, help="Time limit per point."),
    release_memory: bool = typer.Option(
        False, help="Run each point with glibc's MALLOC_MMAP_THRESHOLD_=128 KiB: freed tensors go back to the OS, so "
                    "the peak is live memory, not allocator retention (slower: every large allocation page-faults)."),
    out: Optional[Path] = typer.Option(None, help="Write the points as JSON here."),
) -> None:
    """NeuralMemory tokens/s (forward, forward+backward) and peak memory, against the reference."""
    from .memory import best_of, format_table, reference_available, run_point

    seq_lens = _int_list(lengths, "lengths")
    spec = dict(batch=batch, dim=dim, heads=heads, depth=depth, expansion=expansion, chunk_size=chunk_size,
                repeats=repeats, warmup=warmup)
    impls = ["titans"]
    if reference and reference_available():
        impls.append("reference")
    elif reference:
        typer.echo("titans-pytorch is not installed (pip install -c constraints.txt '.[compare]'): ours only.")
    ref_lens = set(_int_list(reference_lengths, "reference_lengths")) if reference_lengths else set(seq_lens)
    points = []
    for seq in seq_lens:
        runs: dict[str, list] = {impl: [] for impl in impls if impl == "titans" or seq in ref_lens}
        for _ in range(rounds):
            for impl, done in runs.items():
                point = run_point({**spec, "impl": impl, "seq_len": seq}, memory_cap_gib, timeout_s, release_memory)
                typer.echo(f"{impl:>9} seq {seq:>6}: {point.status}, fwd {point.fwd_tok_s or 0:.0f} tok/s, "
                           f"fwd+bwd {point.fwd_bwd_tok_s or 0:.0f} tok/s, peak {point.peak_mib or 0:.0f} MiB", err=True)
                done.append(point)
        points.extend(best_of(done) for done in runs.values())
    typer.echo(f"NeuralMemory dim {dim}, heads {heads}, depth {depth}, expansion {expansion}, chunk {chunk_size}, "
               f"batch {batch}; best of {rounds} round(s) × {repeats} iteration(s); "
               f"{__import__('torch').get_num_threads()} threads; allocator: "
               + ("MALLOC_MMAP_THRESHOLD_=131072" if release_memory else "glibc default"))
    typer.echo(f"machine: {describe_machine()}")
    typer.echo(format_table(points))
    if out is not None:
        out.write_text(json.dumps([p.__dict__ for p in points], indent=2))
        typer.echo(f"wrote {out}")


@bench_app.command("matmul")
def matmul(
    rows: int = typer.Option(16, min=1, help="Rows of the small operand (the memory's chunk size)."),
    d_in: int = typer.Option(256, min=1, help="State matrix rows (the memory's dim)."),
    d_out: int = typer.Option(1024, min=1, help="State matrix columns (dim × expansion)."),
    batch: int = typer.Option(4, min=1),
    dram_mib: int = typer.Option(128, min=1, help="Distinct state memory cycled through for the DRAM case "
                                                  "(make it several times the last-level cache)."),
    repeats: int = typer.Option(5, min=1, help="Timed passes (the best is reported)."),
) -> None:
    """The memory's n-row state products from cache and from DRAM, beside the machine's streaming bandwidth."""
    from .matmul import format_table, measure, stream_gib_s

    typer.echo(format_table(measure(rows, d_in, d_out, batch, dram_mib, repeats)))
    typer.echo(f"streaming read (sum over {dram_mib} MiB): {stream_gib_s(dram_mib, repeats):.1f} GiB/s; "
               f"{__import__('torch').get_num_threads()} threads; machine: {describe_machine()}")
