"""The `titans` command line: train, eval, generate, bench, demo.

Bad input ends with one line on stderr ("error: ...") and exit code 2, never a traceback wall,
and an existing run directory is never overwritten without --force.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional

import typer

from .bench import bench_app

app = typer.Typer(help="Titans neural long-term memory: train, evaluate, generate, benchmark.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(bench_app, name="bench")


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def friendly(command: Callable) -> Callable:
    """Turn the library's ValueErrors (and missing files) into a one-line error and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ValueError, FileNotFoundError, KeyError) as err:
            fail(str(err).strip("'\""))

    return wrapper


def prepare_run_dir(run_dir: Path, force: bool, resume: bool) -> None:
    if resume:
        if not run_dir.is_dir():
            fail(f"--resume: run directory {run_dir} does not exist")
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        if not force:
            fail(f"run directory {run_dir} already exists; pass --force to overwrite it or --resume to continue")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)


@app.command()
@friendly
def train(
    config: Path = typer.Argument(..., help="YAML training config (see configs/)."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Overrides like model.dim=64 steps=10."),
    out: Optional[Path] = typer.Option(None, help="Run directory (default runs/<name>)."),
    force: bool = typer.Option(False, help="Overwrite an existing run directory."),
    resume: bool = typer.Option(False, help="Continue from the run directory's latest checkpoint."),
    quiet: bool = typer.Option(False, help="No progress bar."),
) -> None:
    """Train a model; checkpoints, metrics.jsonl and eval.json go to the run directory."""
    from .train import build_task, load_train_config, setup_distributed
    from .train import train as run_training

    cfg = load_train_config(config, overrides or [])
    build_task(cfg)  # a bad task (e.g. a CSV without numeric columns) fails before anything is written
    run_dir = out or Path("runs") / cfg.run_name
    distributed = setup_distributed()
    import torch.distributed as dist

    if not distributed or dist.get_rank() == 0:
        prepare_run_dir(run_dir, force, resume)
        cfg.to_yaml(run_dir / "config.yaml")
    if distributed:
        dist.barrier()
    result = run_training(cfg, run_dir, resume=resume, quiet=quiet)
    if not distributed or dist.get_rank() == 0:
        for length, metrics in result.evaluation.items():
            typer.echo(f"length {length}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        typer.echo(f"{run_dir / 'eval.json'}")
    if distributed:
        dist.destroy_process_group()


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name} must be positive integers, got {text!r}")
    return values


def _load_checkpoint(ckpt: Path):
    from .train import build_model, build_task
    from .train.checkpoint import load_checkpoint_config, load_weights, resolve_checkpoint

    path = resolve_checkpoint(ckpt)
    cfg = load_checkpoint_config(path)
    task = build_task(cfg)
    model = build_model(cfg, task)
    load_weights(path, model)
    return cfg, task, model.eval()


@app.command("eval")
@friendly
def eval_command(
    ckpt: Path = typer.Argument(..., help="Checkpoint directory or run directory."),
    task: Optional[str] = typer.Option(None, help="Task name (default: the one it was trained on)."),
    lengths: str = typer.Option("256,512,1024,2048", help="Comma-separated evaluation lengths."),
    batches: int = typer.Option(8, min=1),
    batch_size: int = typer.Option(16, min=1),
    seed: int = typer.Option(0),
    out: Optional[Path] = typer.Option(None, help="Write the results JSON here."),
) -> None:
    """Evaluate a checkpoint at several lengths (accuracy / loss table, JSON)."""
    from .tasks import get_task
    from .train import evaluate

    cfg, trained_task, model = _load_checkpoint(ckpt)
    eval_task = trained_task if task is None or task == cfg.task.name else get_task(task)
    results = evaluate(model, eval_task, _int_list(lengths, "lengths"), batches, batch_size, seed)
    typer.echo(f"{'length':>8} " + " ".join(f"{k:>14}" for k in next(iter(results.values()))))
    for length, metrics in results.items():
        typer.echo(f"{length:>8} " + " ".join(f"{v:>14.4f}" for v in metrics.values()))
    payload = {"task": eval_task.name, "checkpoint": str(ckpt), "results": {str(k): v for k, v in results.items()}}
    if out is not None:
        out.write_text(json.dumps(payload, indent=2))
        typer.echo(str(out))


@app.command()
@friendly
def generate(
    ckpt: Path = typer.Argument(..., help="Checkpoint directory or run directory."),
    prompt: str = typer.Option(..., help="Prompt text (bytes for byte-level models; space-separated ids otherwise)."),
    max_new_tokens: int = typer.Option(64, min=0),
    temperature: float = typer.Option(0.8, min=0.0),
    top_k: Optional[int] = typer.Option(None, min=1),
    top_p: Optional[float] = typer.Option(None, min=0.0, max=1.0),
    seed: int = typer.Option(0),
    max_prompt_tokens: int = typer.Option(65_536, help="Longest prompt accepted."),
) -> None:
    """Continue a prompt with a trained language model (constant-size state, token by token)."""
    import torch

    cfg, _, model = _load_checkpoint(ckpt)
    if not hasattr(model, "generate"):
        raise ValueError(f"checkpoint {ckpt} is a {cfg.task.name} forecaster, not a language model")
    byte_level = cfg.model.vocab_size == 256
    ids = list(prompt.encode()) if byte_level else [int(t) for t in prompt.split()]
    if not ids:
        raise ValueError("prompt is empty")
    if len(ids) > max_prompt_tokens:
        raise ValueError(f"prompt has {len(ids)} tokens, more than --max-prompt-tokens {max_prompt_tokens}")
    if max(ids) >= cfg.model.vocab_size or min(ids) < 0:
        raise ValueError(f"prompt token ids must lie in [0, {cfg.model.vocab_size})")
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([ids]), max_new_tokens, temperature, top_k, top_p, generator=generator)
    new = out[0, len(ids):].tolist()
    typer.echo(bytes(new).decode("utf-8", errors="replace") if byte_level else " ".join(map(str, new)))


@app.command()
@friendly
def demo(
    out: Path = typer.Option(Path("runs/demo"), help="Output directory."),
    force: bool = typer.Option(False, help="Overwrite an existing output directory."),
    configs: Optional[list[Path]] = typer.Option(None, help="Training configs (default: configs/demo/*.yaml)."),
    quiet: bool = typer.Option(False),
) -> None:
    """Train a Titans model and the SWA baseline on a needle task, test at 1-8x the training length."""
    from .train.demo import run_demo

    prepare_run_dir(out, force, resume=False)
    result_path = run_demo(out, configs, quiet=quiet)
    typer.echo(str(result_path))


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
