"""Throughput and peak memory of `NeuralMemory`, side by side with the public reference package.

Every (implementation, sequence length) point runs in a fresh subprocess so that its peak resident
memory is its own, under an address-space cap so that a run which would exhaust the machine fails
cleanly ("out of memory") instead. The reference (`titans-pytorch==0.5.5`, optional extra
`compare`) is measured in the same run with the same shapes when it is installed.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..machine import limit_address_space, rss_mib, run_isolated


@dataclass
class BenchPoint:
    impl: str
    seq_len: int
    batch: int
    status: str = "ok"  # ok | out of memory | timeout | error: ...
    fwd_tok_s: Optional[float] = None
    fwd_bwd_tok_s: Optional[float] = None
    peak_mib: Optional[float] = None  # peak resident memory above the process's footprint before the run


def _build(spec: dict) -> torch.nn.Module:
    """The layer a point measures: ours ("titans", or "titans:<implementation>", with the default rule;
    "titans-paper" with the paper's unbounded one, bench stability's RULES; `spec["loss"]`, where given, the inner loss
    in place of the squared one; `spec["implementation"]` picks the chunk loop, None: its own choice), or the
    reference package's ("reference")."""
    if spec["impl"] != "reference":
        from titans.bench.stability import RULES
        from titans.memory import NeuralMemory

        rule = RULES["paper" if spec["impl"] == "titans-paper" else "ours"]
        if spec.get("loss") is not None:
            rule = rule.replace(loss=spec["loss"])
        return NeuralMemory(spec["dim"], heads=spec["heads"], depth=spec["depth"], expansion=spec["expansion"],
                            chunk_size=spec["chunk_size"], rule=rule, implementation=spec.get("implementation"))
    from titans_pytorch import NeuralMemory as ReferenceMemory

    return ReferenceMemory(
        dim=spec["dim"], chunk_size=spec["chunk_size"], heads=spec["heads"],
        default_model_kwargs=dict(depth=spec["depth"], expansion_factor=float(spec["expansion"])),
    )


def _worker(spec: dict) -> BenchPoint:
    """Runs inside the subprocess: time forward and forward+backward, track peak memory (resident on the CPU,
    allocated on a GPU, whose work is waited for before each clock read)."""
    torch.manual_seed(0)
    point = BenchPoint(spec["impl"], spec["seq_len"], spec["batch"])
    device = torch.device(spec.get("device", "cpu"))
    model = _build(spec).to(device)
    x = torch.randn(spec["batch"], spec["seq_len"], spec["dim"]).to(device)
    tokens = spec["batch"] * spec["seq_len"]
    cuda = device.type == "cuda"

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    base = torch.cuda.memory_allocated(device) / 2**20 if cuda else rss_mib()
    try:
        with torch.no_grad():
            for _ in range(spec["warmup"]):
                model(x)
            times = []
            for _ in range(spec["repeats"]):
                start = clock()
                model(x)
                times.append(clock() - start)
        point.fwd_tok_s = tokens / min(times)
        times = []
        # Warm-up iterations let the allocator reach its steady state (the first ones page-fault on
        # fresh memory), which is what a training run sees after its first steps.
        for i in range(spec["warmup"] + spec["repeats"]):
            model.zero_grad(set_to_none=True)
            start = clock()
            y = model(x)[0]
            y.float().pow(2).mean().backward()
            if i >= spec["warmup"]:
                times.append(clock() - start)
        point.fwd_bwd_tok_s = tokens / min(times)
    except (RuntimeError, MemoryError) as err:
        if "memory" not in str(err).lower() and not isinstance(err, MemoryError):
            raise
        point.status = "out of memory"
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    point.peak_mib = peak - base
    return point


def best_of(points: list[BenchPoint]) -> BenchPoint:
    """One point from several runs of the same (implementation, length): the best throughputs of the runs that
    finished, and the highest peak (the conservative one); a failure only if every run failed."""
    done = [p for p in points if p.status == "ok"]
    if not done:
        return points[-1]
    return BenchPoint(done[0].impl, done[0].seq_len, done[0].batch, "ok", max(p.fwd_tok_s for p in done),
                      max(p.fwd_bwd_tok_s for p in done), max(p.peak_mib for p in done))


def run_point(spec: dict, memory_cap_gib: float, timeout_s: float, release_memory: bool = False) -> BenchPoint:
    """Run one point in a subprocess with an address-space cap and a time limit.

    glibc's default malloc raises its mmap threshold as large blocks are freed, after which tensors of a few
    MiB come from the heap and freed ones stay resident (fragmentation): peak RSS then grows with the number of
    allocations, not only with live tensors. `release_memory` pins the threshold at 128 KiB for the subprocess.
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"} if release_memory else None
    status, point = run_isolated("titans.bench.memory", spec, memory_cap_gib, timeout_s, env)
    if point is None:
        return BenchPoint(spec["impl"], spec["seq_len"], spec["batch"], status=status)
    return BenchPoint(**point)


def format_table(points: list[BenchPoint]) -> str:
    """Markdown table; a ratio column when both implementations ran at a length."""
    by_len: dict[int, dict[str, BenchPoint]] = {}
    for p in points:
        by_len.setdefault(p.seq_len, {})[p.impl] = p

    def cell(p: Optional[BenchPoint], attr: str, fmt: str) -> str:
        if p is None:
            return "-"
        if p.status != "ok":
            return p.status
        return format(getattr(p, attr), fmt)

    lines = [
        "| seq | titans fwd tok/s | titans fwd+bwd tok/s | titans peak MiB | reference fwd tok/s "
        "| reference fwd+bwd tok/s | reference peak MiB | fwd+bwd speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for seq in sorted(by_len):
        ours, ref = by_len[seq].get("titans"), by_len[seq].get("reference")
        ratio = "-"
        if ours and ref and ours.status == ref.status == "ok":
            ratio = f"{ours.fwd_bwd_tok_s / ref.fwd_bwd_tok_s:.1f}x"
        lines.append(
            f"| {seq} | {cell(ours, 'fwd_tok_s', '.0f')} | {cell(ours, 'fwd_bwd_tok_s', '.0f')} | "
            f"{cell(ours, 'peak_mib', '.0f')} | {cell(ref, 'fwd_tok_s', '.0f')} | "
            f"{cell(ref, 'fwd_bwd_tok_s', '.0f')} | "
            f"{cell(ref, 'peak_mib', '.0f')} | {ratio} |"
        )
    return "\n".join(lines)


def format_implementations(points: list[BenchPoint], impls: list[str]) -> str:
    """Markdown: ours under several implementations at each length, and each one's fwd+bwd tokens/s as a multiple
    of the first's."""
    by_len: dict[int, dict[str, BenchPoint]] = {}
    for p in points:
        by_len.setdefault(p.seq_len, {})[p.impl] = p
    names = [impl.partition(":")[2] or impl for impl in impls]
    lines = ["| seq | " + " | ".join(f"{n} fwd tok/s | {n} fwd+bwd tok/s" for n in names) + " | "
             + " | ".join(f"fwd+bwd, {n} / {names[0]}" for n in names[1:]) + " |",
             "|---:|" + "---:|" * (3 * len(names) - 1)]
    for seq in sorted(by_len):
        row = [by_len[seq].get(impl) for impl in impls]
        cells = [f"{p.fwd_tok_s:.0f} | {p.fwd_bwd_tok_s:.0f}" if p and p.status == "ok" else
                 f"{p.status if p else '-'} | -" for p in row]
        first = row[0]
        ratios = [f"{p.fwd_bwd_tok_s / first.fwd_bwd_tok_s:.2f}"
                  if p and first and p.status == first.status == "ok" else "-" for p in row[1:]]
        lines.append(f"| {seq} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def format_rule_cost(points: list[BenchPoint]) -> str:
    """Markdown: the default rule's throughput against the paper's unbounded rule, where both ran."""
    by_len: dict[int, dict[str, BenchPoint]] = {}
    for p in points:
        by_len.setdefault(p.seq_len, {})[p.impl] = p
    lines = ["| seq | default rule fwd tok/s | paper rule fwd tok/s | default rule fwd+bwd tok/s "
             "| paper rule fwd+bwd tok/s | fwd+bwd, default / paper |", "|---:|---:|---:|---:|---:|---:|"]
    for seq in sorted(by_len):
        ours, paper = by_len[seq].get("titans"), by_len[seq].get("titans-paper")
        if not (ours and paper and ours.status == paper.status == "ok"):
            continue
        lines.append(f"| {seq} | {ours.fwd_tok_s:.0f} | {paper.fwd_tok_s:.0f} | {ours.fwd_bwd_tok_s:.0f} | "
                     f"{paper.fwd_bwd_tok_s:.0f} | {ours.fwd_bwd_tok_s / paper.fwd_bwd_tok_s:.3f} |")
    return "\n".join(lines)


def parse_losses(text: str) -> dict[str, dict]:
    """`--loss`'s comma-separated entries, each a loss's name (`huber`) or its name and fields (`huber:gated=true`,
    `lp:p=4:eps=1e-4`; values read as YAML): {entry: the loss as a config mapping}, each checked as `MemoryRule`
    checks a loss (a ValueError naming what is wrong)."""
    from titans.config import load_yaml
    from titans.memory import MemoryRule

    losses = {}
    for entry in (item.strip() for item in text.split(",")):
        if not entry:
            continue
        name, *fields = entry.split(":")
        loss: dict = {"name": name}
        for field in fields:
            key, eq, value = field.partition("=")
            if not eq or not key:
                raise ValueError(f"--loss {entry!r}: a loss's field is written key=value, got {field!r}")
            loss[key] = load_yaml(value)
        MemoryRule(loss=loss)  # refuses an unknown loss or field, naming it
        losses[entry] = loss
    if not losses:
        raise ValueError(f"--loss names no loss, got {text!r}")
    return losses


def format_loss_cost(points: list[BenchPoint], losses: list[str]) -> str:
    """Markdown: our memory under each loss (impl `titans-loss:<entry>`) beside the squared loss (`titans`), measured
    in the same run, and each one's forward+backward tokens/s as a multiple of the squared loss's."""
    by_len: dict[int, dict[str, BenchPoint]] = {}
    for p in points:
        by_len.setdefault(p.seq_len, {})[p.impl] = p
    names = ["squared", *losses]
    lines = ["| seq | " + " | ".join(f"{n} fwd+bwd tok/s" for n in names) + " | "
             + " | ".join(f"{n} / squared" for n in losses) + " |", "|---:|" + "---:|" * (2 * len(names) - 1)]
    for seq in sorted(by_len):
        row = [by_len[seq].get("titans"), *(by_len[seq].get(f"titans-loss:{n}") for n in losses)]
        cells = [f"{p.fwd_bwd_tok_s:.0f}" if p and p.status == "ok" else (p.status if p else "-") for p in row]
        first = row[0]
        ratios = [f"{p.fwd_bwd_tok_s / first.fwd_bwd_tok_s:.3f}"
                  if p and first and p.status == first.status == "ok" else "-" for p in row[1:]]
        lines.append(f"| {seq} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def _main_worker(arg: str) -> None:
    print(json.dumps(asdict(_worker(limit_address_space(json.loads(arg))))))


if __name__ == "__main__":
    _main_worker(sys.argv[1])
