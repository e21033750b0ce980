"""Benchmarks, run as commands (`titans bench ...`), never as timed tests."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ..machine import describe_machine, reference_available

bench_app = typer.Typer(help="Throughput and memory benchmarks.", no_args_is_help=True)


@bench_app.callback()
def _group() -> None:
    """Throughput and memory benchmarks (commands, not tests)."""


def _provenance() -> dict[str, str]:
    """What every bench JSON records first: the command that wrote it and the machine it ran on."""
    return {"command": "titans " + " ".join(sys.argv[1:]), "machine": describe_machine()}


def _int_list(text: str, name: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise typer.BadParameter(f"{name} must be integers of at least {minimum}, got {text!r}")
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
    paper_rule: bool = typer.Option(False, help="Also measure our memory with the paper's unbounded rule (no input "
                                                "normalisation, no bounds): what the default rule costs."),
    loss: Optional[str] = typer.Option(
        None, help="Also measure our memory under these inner losses, next to the squared loss in the same run (what "
                   "each costs): comma-separated names (huber,lp) or a name with its fields "
                   "(huber:gated=true:delta=0.5, lp:p=4)."),
    reference_lengths: Optional[str] = typer.Option(
        "512,1024,2048,8192", help="Lengths at which to run the reference (it is slow and memory hungry)."
    ),
    memory_cap_gib: float = typer.Option(20.0, help="Address-space cap per point; above it a point reports OOM."),
    timeout_s: float = typer.Option(900.0, help="Time limit per point."),
    release_memory: bool = typer.Option(
        False, help="Run each point with glibc's MALLOC_MMAP_THRESHOLD_=128 KiB: freed tensors go back to the OS, so "
                    "the peak is live memory, not allocator retention (slower: every large allocation page-faults)."),
    device: str = typer.Option("cpu", help="Where to run: cpu, or cuda (peak memory is then the GPU's allocated)."),
    implementation: Optional[str] = typer.Option(
        None, help="Our memory's chunk loop: fused, triton, autograd or compile (parallel_memory's implementation); "
                   "default: its own choice, triton on CUDA where installed, else fused. Several, comma-separated: "
                   "each is measured at every length (alternating, like --rounds) and compared with the first; the "
                   "reference is then not run."),
    out: Optional[Path] = typer.Option(None, help="Write the points as JSON here."),
) -> None:
    """NeuralMemory tokens/s (forward, forward+backward) and peak memory, against the reference."""
    from ..bench.memory import (
        best_of,
        format_implementations,
        format_loss_cost,
        format_rule_cost,
        format_table,
        parse_losses,
        run_point,
    )
    from ..memory.parallel import IMPLEMENTATIONS

    seq_lens = _int_list(lengths, "lengths")
    try:
        losses = parse_losses(loss) if loss is not None else {}
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"device must be cpu or cuda, got {device!r}")
    chosen = _choices(implementation, "implementation", IMPLEMENTATIONS) if implementation is not None else [None]
    spec = dict(batch=batch, dim=dim, heads=heads, depth=depth, expansion=expansion, chunk_size=chunk_size,
                repeats=repeats, warmup=warmup, device=device, implementation=chosen[0])
    # ours under each chosen implementation: "titans", or "titans:<implementation>" when several are compared
    ours = {f"titans:{name}": name for name in chosen} if len(chosen) > 1 else {"titans": chosen[0]}
    impls = list(ours) + (["titans-paper"] if paper_rule else []) + [f"titans-loss:{name}" for name in losses]
    if len(chosen) > 1:
        reference = False
    if reference and reference_available():
        impls.append("reference")
    elif reference:
        typer.echo("titans-pytorch is not installed (pip install -c constraints.txt '.[compare]'): ours only.")
    ref_lens = set(_int_list(reference_lengths, "reference_lengths")) if reference_lengths else set(seq_lens)
    points = []
    for seq in seq_lens:
        runs: dict[str, list] = {impl: [] for impl in impls if impl != "reference" or seq in ref_lens}
        for _ in range(rounds):
            for impl, done in runs.items():
                point = run_point({**spec, "impl": impl, "implementation": ours.get(impl, chosen[0]), "seq_len": seq,
                                   "loss": losses.get(impl.removeprefix("titans-loss:"))},
                                  memory_cap_gib, timeout_s, release_memory)
                typer.echo(f"{impl:>12} seq {seq:>6}: {point.status}, fwd {point.fwd_tok_s or 0:.0f} tok/s, "
                           f"fwd+bwd {point.fwd_bwd_tok_s or 0:.0f} tok/s, peak {point.peak_mib or 0:.0f} MiB",
                           err=True)
                done.append(point)
        points.extend(best_of(done) for done in runs.values())
    threads = __import__("torch").get_num_threads()
    typer.echo(f"NeuralMemory dim {dim}, heads {heads}, depth {depth}, expansion {expansion}, chunk {chunk_size}, "
               f"batch {batch}, on {device}, implementation {implementation or 'default'}; "
               f"best of {rounds} round(s) × {repeats} iteration(s); "
               f"{threads} threads; allocator: "
               + ("MALLOC_MMAP_THRESHOLD_=131072" if release_memory else "glibc default"))
    typer.echo(f"machine: {describe_machine()}")
    typer.echo(format_implementations(points, list(ours)) if len(chosen) > 1 else format_table(points))
    if paper_rule:
        typer.echo(format_rule_cost(points))
    if losses:
        typer.echo(format_loss_cost(points, list(losses)))
    if out is not None:
        # as every other bench command's JSON: what ran it and where, beside the points (best of the rounds)
        out.write_text(json.dumps({**_provenance(),
                                   "threads": threads, "rounds": rounds,
                                   "setup": {key: value for key, value in spec.items() if key != "implementation"},
                                   "points": [p.__dict__ for p in points]}, indent=2))
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
    from ..bench.matmul import format_table, measure, stream_gib_s

    typer.echo(format_table(measure(rows, d_in, d_out, batch, dram_mib, repeats)))
    typer.echo(f"streaming read (sum over {dram_mib} MiB): {stream_gib_s(dram_mib, repeats):.1f} GiB/s; "
               f"{__import__('torch').get_num_threads()} threads; machine: {describe_machine()}")


def _float_list(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not values or not all(0 < v < float("inf") for v in values):
        raise typer.BadParameter(f"{name} must be positive finite numbers, got {text!r}")
    return values


def _choices(text: str, name: str, allowed: tuple[str, ...]) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise typer.BadParameter(f"{name} must be comma-separated values from {', '.join(allowed)}, got {text!r}")
    return values


@bench_app.command("stability")
def stability(
    tokens: int = typer.Option(16384, min=1, help="Tokens streamed through one state per stream case."),
    train_tokens: int = typer.Option(4096, min=0, help="Of those, the first ones run with a backward pass."),
    depths: str = typer.Option("1,2,3,4", help="Memory depths."),
    activations: str = typer.Option("gelu,silu"),
    momentum: str = typer.Option("on,off"),
    chunk_sizes: str = typer.Option("1,16,64"),
    scales: str = typer.Option("0.001,1,1000", help="Input scales: x = randn · scale."),
    gates: str = typer.Option("init,worst", help="init: gates at initialisation; worst: θ = θ_max, η = 1, α = 0."),
    dtypes: str = typer.Option("float32,bf16-autocast"),
    rules: str = typer.Option("ours,paper", help="ours: the library's default rule; paper: the unbounded rule."),
    train_steps: int = typer.Option(60, min=0, help="Steps per training-sweep run (0: no training sweep)."),
    lrs: str = typer.Option("0.001,0.01,0.1", help="Learning rates of the training sweep."),
    workers: int = typer.Option(2, min=1, help="Processes side by side (one torch thread each)."),
    out: Optional[Path] = typer.Option(None, help="Write every case's result and the summaries as JSON here."),
) -> None:
    """The memory's inner loop at any input scale, depth, chunk size and gates: the fraction of runs that stay finite,
    with the default rule and the paper's, in streams (test time and training) and in a training sweep."""
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial
    from multiprocessing import get_context

    from ..bench.stability import (
        RULES,
        StabilityGrid,
        as_json,
        describe_streams,
        format_summary,
        run_stream,
        run_training,
        summarize,
    )

    grid = StabilityGrid(
        depths=_int_list(depths, "depths"), activations=_choices(activations, "activations", ("gelu", "silu")),
        momenta=[m == "on" for m in _choices(momentum, "momentum", ("on", "off"))],
        chunk_sizes=_int_list(chunk_sizes, "chunk_sizes"), scales=_float_list(scales, "scales"),
        gates=_choices(gates, "gates", ("init", "worst")),
        dtypes=_choices(dtypes, "dtypes", ("float32", "bf16-autocast")),
        lrs=_float_list(lrs, "lrs"), rules=_choices(rules, "rules", tuple(RULES)))
    streams, trains = grid.stream_cases(), grid.train_cases() if train_steps else []
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_one_thread) as pool:
        stream_results = list(pool.map(partial(run_stream, tokens=tokens, train_tokens=train_tokens), streams))
        train_results = list(pool.map(partial(run_training, steps=train_steps), trains))
    stream_axes = ["depth", "activation", "momentum", "chunk_size", "scale", "gates", "dtype"]
    summaries = {"streams": summarize(stream_results, stream_axes)}
    typer.echo(f"machine: {describe_machine()}; {tokens} tokens per stream, the first {train_tokens} with a backward "
               f"pass; {len(streams)} stream cases, {len(trains)} training runs of {train_steps} steps")
    typer.echo(format_summary("streams: finite runs (outputs, states, gradients)", summaries["streams"]))
    for rule in grid.rules:
        typer.echo(describe_streams(stream_results, rule))
    if train_results:
        summaries["training"] = summarize(train_results, ["depth", "scale", "lr"])
        typer.echo(format_summary("training sweep: finite runs (loss, parameters)", summaries["training"]))
    if out is not None:
        out.write_text(json.dumps({
            **_provenance(), "tokens": tokens,
            "train_tokens": train_tokens, "train_steps": train_steps, "summaries": summaries,
            "streams": as_json(stream_results), "training": as_json(train_results)}, indent=1))
        typer.echo(f"wrote {out}")


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@bench_app.command("recall")
def recall(
    variants: str = typer.Option("lmm,mac,mag,mal,transformer,swa,lstm,gated_deltanet", help="Model variants."),
    tasks: str = typer.Option("passkey,mqar,kv_recall", help="Recall tasks."),
    steps: int = typer.Option(1000, min=1, help="Training steps per run."),
    train_length: int = typer.Option(128, min=1, help="Training length; evaluation at 1x, 4x and 8x."),
    seeds: int = typer.Option(1, min=1, help="Seeds per (variant, task)."),
    workers: int = typer.Option(2, min=1, help="Runs side by side (one torch thread each)."),
    run_dir: Path = typer.Option(Path("runs/bench-recall"), help="Where the runs go; finished runs are reused."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="A change to the defaults for every run, as "
                                                                      "titans train takes it: "
                                                                      "model.memory.max_lr=0.02"),
    out: Optional[Path] = typer.Option(None, help="Write the table's numbers and every run's details as JSON here."),
) -> None:
    """Every variant with the default settings, trained on passkey, MQAR and key-value recall across noise; accuracy
    at 1x, 4x and 8x the training length."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from ..bench.recall import MULTIPLES, SIZES, TASKS, collect, format_table, recall_config
    from ..experiments import train_one
    from ..models import VARIANTS

    chosen_variants = _choices(variants, "variants", VARIANTS)
    chosen_tasks = _choices(tasks, "tasks", tuple(TASKS))
    configs = [recall_config(v, t, s, steps, train_length, overrides) for t in chosen_tasks for v in chosen_variants
               for s in range(seeds)]
    dirs = [run_dir / cfg.run_name for cfg in configs]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        summaries = list(pool.map(train_one, configs, dirs))
    rows = [collect(cfg, summary) for cfg, summary in zip(configs, summaries)]
    typer.echo(f"machine: {describe_machine()}; {steps} steps at {train_length} tokens, batch 32, {seeds} seed(s); "
               f"sizes {SIZES}" + (f"; changed: {', '.join(overrides)}" if overrides else "; defaults"))
    typer.echo(format_table(rows, chosen_tasks))
    skipped = sum(r["skipped_steps"] for r in rows)
    typer.echo(f"skipped training steps (non-finite loss or gradient), all runs: {skipped}")
    if out is not None:
        out.write_text(json.dumps({
            **_provenance(), "steps": steps,
            "train_length": train_length, "multiples": list(MULTIPLES), "sizes": SIZES, "overrides": overrides or [],
            "tasks": {t: {"options": TASKS[t].options, "metric": TASKS[t].metric, "about": TASKS[t].about}
                      for t in chosen_tasks},
            "runs": rows}, indent=1))
        typer.echo(f"wrote {out}")


@bench_app.command("backward")
def backward(
    checkpoint: Path = typer.Argument(..., help="A checkpoint, or a run directory (its latest checkpoint)."),
    steps: Optional[str] = typer.Option(None, help="Training steps whose batches to replay, comma-separated "
                                                   "(default: the checkpoint's own step, the batch it trained on "
                                                   "next); each from the checkpoint's weights."),
    piece: Optional[int] = typer.Option(None, min=1, help="Positions per call, a boundary after each (default: "
                                                          "MAC's segment, else the memory's chunk)."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="Replay under another rule, a model field that "
                                                                      "keeps the parameters' shapes: "
                                                                      "model.memory.max_grad_norm=1"),
    float64: bool = typer.Option(False, "--float64", help="Replay in double precision (the exact gradient; float32, "
                                                           "as trained, also amplifies rounding where the map "
                                                           "expands)."),
    out: Optional[Path] = typer.Option(None, help="Write the replays as JSON here."),
) -> None:
    """The memory's backward pass on a trained checkpoint: per block, the gradient of the training loss with respect
    to the memory state at every segment boundary, the loss and the gradient norm before clipping."""

    import torch

    from ..bench.backward import replay

    chosen = _int_list(steps, "steps", minimum=0) if steps else None
    precision = "float64" if float64 else "float32"
    try:
        path, cfg, replays = replay(checkpoint, chosen, piece, overrides or [], getattr(torch, precision))
    except (ValueError, FileNotFoundError) as err:
        raise typer.BadParameter(str(err)) from None
    typer.echo(f"machine: {describe_machine()}; {path} ({cfg.model.variant}, seed {cfg.seed}, {precision})"
               + (f"; changed: {', '.join(overrides)}" if overrides else ""))

    def factors(values: list[float | None]) -> str:
        return ", ".join("-" if g is None else f"{g:.3g}" for g in values)

    for r in replays:
        typer.echo(f"step {r.step}: loss {r.loss:.4f}, gradient norm before clipping {r.grad_norm:.4g}; largest "
                   f"growth per segment back, per block: {factors(r.growth())} (the memory's update alone: "
                   f"{factors(r.update_growth())})")
    if out is not None:
        out.write_text(json.dumps({**_provenance(),
                                   "checkpoint": str(path), "overrides": overrides or [],
                                   "dtype": precision,
                                   "replays": [{**dataclasses.asdict(r), "growth": r.growth(),
                                                "update_growth": r.update_growth()} for r in replays]},
                                  indent=1))
        typer.echo(f"wrote {out}")


@bench_app.command("generate")
def generate(
    variants: str = typer.Option("transformer,lmm,mac,mag,mal", help="Model variants."),
    prompt_len: int = typer.Option(1024, min=2, help="Prompt tokens, read into the state before the timing."),
    new_tokens: int = typer.Option(64, min=1, help="Tokens generated (greedy) per timed run."),
    rounds: int = typer.Option(5, min=1, help="Timed runs of every model, interleaved; the best of each is reported."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch threads (default: torch's, as the efficiency "
                                                            "experiment runs)."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="A change to the efficiency experiment's model, "
                                                                      "as `titans train` takes it: model.dim=256"),
    compile: bool = typer.Option(False, "--compile", help="Also measure every variant with its one-token step "
                                                          "compiled (generate(decode='compiled')); compiling takes "
                                                          "minutes on a CPU."),
    out: Optional[Path] = typer.Option(None, help="Write the rows as JSON here."),
) -> None:
    """Generation tokens/s of every variant at the efficiency experiment's model config, interleaved in one process,
    with the ratio to the transformer measured in the same run and the ATen operations per token."""

    import torch

    from ..bench.generate import format_table, measure_generation
    from ..config import apply_overrides
    from ..experiments.spec import load_experiment
    from ..models import VARIANTS

    if threads is not None:
        torch.set_num_threads(threads)
    base = apply_overrides({"model": load_experiment("efficiency").base["model"]}, overrides or [])
    rows = measure_generation(base["model"], _choices(variants, "variants", VARIANTS), prompt_len, new_tokens, rounds,
                              compile=compile)
    typer.echo(f"machine: {describe_machine()}; {torch.get_num_threads()} threads; {new_tokens} tokens after a "
               f"{prompt_len}-token prompt, best of {rounds} interleaved rounds; model {base['model']}")
    typer.echo(format_table(rows))
    if out is not None:
        out.write_text(json.dumps({**_provenance(),
                                   "model": base["model"], "prompt_len": prompt_len, "new_tokens": new_tokens,
                                   "rounds": rounds, "rows": rows}, indent=1))
        typer.echo(f"wrote {out}")


@bench_app.command("loader")
def loader(
    data: Path = typer.Argument(..., help="A token shard directory (titans data prepare --out)."),
    split: str = typer.Option("train", help="train or val."),
    lengths: str = typer.Option("512,2048,4096", help="Tokens per row, comma-separated."),
    batch: int = typer.Option(8, min=1, help="Rows per batch (one rank's micro-batch)."),
    seconds: float = typer.Option(3.0, min=0.1, help="How long to draw batches at each length."),
    threads: int = typer.Option(1, min=1, help="torch threads (one: a data loader shares its cores)."),
    out: Optional[Path] = typer.Option(None, help="Write the points as JSON here."),
) -> None:
    """Tokens per second from memory-mapped shards into (pinned, where there is a GPU) batches, as training draws."""
    import torch

    from ..bench.loader import as_record, measure_loader

    torch.set_num_threads(threads)
    try:
        points = [measure_loader(str(data), split, length, batch, seconds) for length in _int_list(lengths, "lengths")]
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    for p in points:
        typer.echo(f"length {p.length:>6} x {p.batch_size}: {p.tokens_per_s / 1e6:8.1f} M tokens/s "
                   f"({p.batches} batches in {p.seconds:.1f} s, {'pinned' if p.pinned else 'pageable: no GPU'})")
    if out is not None:
        record = {"command": "titans bench loader " + " ".join(sys.argv[3:]), "machine": describe_machine(),
                  "torch_threads": threads, "points": [as_record(p) for p in points]}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2))
        typer.echo(str(out))


@bench_app.command("gpu")
def gpu(
    out: Path = typer.Option(..., help="A folder: one JSON per benchmark (matmul, layer, model, decode, precision)."),
    only: str = typer.Option(",".join(("matmul", "layer", "model", "decode", "precision")),
                             help="Benchmarks to run, comma-separated, in order."),
    quick: bool = typer.Option(False, "--quick", help="Toy sizes: the whole run dry-runs on a CPU in a minute."),
    device: Optional[str] = typer.Option(None, help="cuda (default where there is one) or cpu (with --quick)."),
) -> None:
    """The GPU benchmarks of docs/bench/gpu (the memory layer against causal SDPA and titans-pytorch, a 125M model's
    training step per variant, decoding at 32K context, the kernels' precision against float64), each writing its
    JSON as it finishes; the summary table last."""
    import torch

    from ..bench.gpu import BENCHMARKS, run, summary

    chosen = _choices(only, "only", BENCHMARKS)
    if not quick and (device == "cpu" or (device is None and not torch.cuda.is_available())):
        raise typer.BadParameter("the full sizes need a GPU: pass --quick to dry-run on the CPU")
    command = f"titans bench gpu --out {out} --only {','.join(chosen)}" + (" --quick" if quick else "") + \
        (f" --device {device}" if device else "")
    run(out, tuple(chosen), quick, device, command=command)
    typer.echo(summary(out))
