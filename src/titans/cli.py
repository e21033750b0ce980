"""The `titans` command line: data, train, eval, generate, export, bench, demo, experiment.

Bad input ends with one line on stderr per problem ("error: ...", e.g. each refused field of a config) and exit
code 2, never a traceback wall (the commands turn the library's ValueErrors into those lines; `main` does the same
for usage errors such as a missing argument), and an existing run directory is never overwritten without --force.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from .commands.bench import bench_app

app = typer.Typer(help="Titans neural long-term memory: train, evaluate, generate, benchmark, demo.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(bench_app, name="bench")
experiment_app = typer.Typer(help="Experiments: grids of runs (configs/experiments/*.yaml), their JSON, the report.",
                             no_args_is_help=True)
app.add_typer(experiment_app, name="experiment")
data_app = typer.Typer(help="Data for language models: a tokenizer and token shards from local text.",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")

USAGE_ERROR = 2


def one_line(message: str) -> str:
    return " ".join(str(message).split())


def friendly(command: Callable) -> Callable:
    """Turn the library's ValueErrors and file errors into `error: ...` lines and exit code 2: one line, or one per
    line of the message (a config refused for several fields says so one field a line)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (ValueError, OSError) as err:
            for line in str(err).splitlines() or [""]:
                typer.echo(f"error: {one_line(line)}", err=True)
            raise typer.Exit(USAGE_ERROR) from None
        except (MemoryError, RuntimeError) as err:  # a size the machine cannot hold: say so, not a traceback
            if not isinstance(err, MemoryError) and "allocate" not in str(err):
                raise
            typer.echo(f"error: out of memory ({one_line(err)[:200]}); reduce the sizes in the config", err=True)
            raise typer.Exit(USAGE_ERROR) from None

    return wrapper


@app.command()
@friendly
def train(
    config: Path = typer.Argument(..., help="YAML training config (see configs/)."),
    overrides: list[str] | None = typer.Argument(
        None, help="Overrides like model.dim=64 steps=10 (top-level fields may also be written train.steps=10)."),
    out: Path | None = typer.Option(None, help="Run directory (default runs/<name>)."),
    force: bool = typer.Option(False, help="Delete an existing run directory (made by titans) and start over."),
    resume: bool = typer.Option(False, help="Continue the run directory from its latest checkpoint."),
    quiet: bool = typer.Option(False, help="No progress bar."),
) -> None:
    """Train a model: checkpoints, metrics.jsonl and eval.json go to the run directory (eval.json's path is the
    last line).

    Under torchrun (`torchrun --nproc_per_node 2 -m titans.cli train ...`) it trains data-parallel, replicated (DDP)
    or, with parallel=fsdp, sharded (FSDP2).
    """
    import torch.distributed as dist

    from .train import load_train_config, setup_distributed
    from .train import train as run_training

    cfg = load_train_config(config, overrides or [])
    run_dir = out or cfg.run_dir_in(Path("runs"))
    distributed = setup_distributed(cfg.device, sharded=cfg.parallel == "fsdp")
    lead = not distributed or dist.get_rank() == 0
    try:
        result = run_training(cfg, run_dir, resume=resume, quiet=quiet, force=force)
    finally:
        if distributed:
            dist.destroy_process_group()
    if lead:
        typer.echo(f"skipped steps (non-finite loss or gradient): {result.skipped_steps} of {result.step}")
        peak, peak_step = result.peak_grad
        typer.echo(f"largest gradient norm before clipping: {peak:.4g} at step {peak_step} "
                   f"(optim.grad_clip {cfg.optim.grad_clip})")
        lowered, bounded = result.momentum_bound
        if bounded:
            typer.echo(f"learned θ_t lowered by the momentum-gain bound (κ = {cfg.model.memory.max_momentum_step:g}): "
                       f"{lowered} of {bounded} ({lowered / bounded:.3%})")
        for length, metrics in result.evaluation.items():
            typer.echo(f"length {length}: " + ", ".join(metric_text(k, v) for k, v in metrics.items()))
        typer.echo(str(run_dir / "eval.json"))


def parse_lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--lengths must be positive integers, got {text!r}")
    return values


def load_for_inference(ckpt: Path, device: str):
    """(checkpoint path, config, task, model in eval mode) of a checkpoint, or of a run directory's latest; the model's
    parameters in the dtype training kept them in (float32 for a bfloat16 run: its master weights)."""
    from .train.loop import load_trained

    return load_trained(ckpt, device)


@app.command("eval")
@friendly
def eval_command(
    ckpt: Path = typer.Argument(..., help="Checkpoint directory, or a run directory (its latest checkpoint)."),
    task: str | None = typer.Option(None, help="Task name (default: the task it was trained on, same options)."),
    lengths: str | None = typer.Option(None, help="Comma-separated lengths (default: the config's eval_lengths)."),
    batches: int | None = typer.Option(None, min=1, help="Batches per length (default: the config's)."),
    batch_size: int | None = typer.Option(None, min=1, help="Sequences per batch (default: the config's)."),
    seed: int = typer.Option(0, help="Evaluation set (0 is the set training reports on)."),
    split: str | None = typer.Option(None, help="Tasks read from data: the split to evaluate on, train or val "
                                                "(lm_bytes), train, val or test (forecast_csv), train or test (ucr); "
                                                "default the split training reports (val; test for ucr)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto."),
    out: Path | None = typer.Option(None, help="Results JSON (default: eval_<task>[_<split>][_seed<seed>]_step<N>"
                                               ".json in the run directory, which pruning checkpoints keeps)."),
    force: bool = typer.Option(False, help="Overwrite an existing --out file."),
) -> None:
    """Evaluate a checkpoint at several lengths: prints a table, writes a JSON (its path is the last line)."""
    from .tasks import get_task
    from .train import EvalPlan, evaluate
    from .train.checkpoint import load_trainer_state
    from .train.config import check_model_fits_task

    if out is not None and out.exists() and not force:
        raise ValueError(f"--out {out} already exists; pass --force to overwrite it")
    path, cfg, trained_task, model = load_for_inference(ckpt, device)
    eval_task = (trained_task if task is None or task == cfg.task.name else get_task(task)).held_out(split)
    if (eval_task.vocab_size is None) != (trained_task.vocab_size is None):
        kinds = {True: "a series task", False: "a token task"}
        raise ValueError(f"--task {eval_task.name} is {kinds[eval_task.vocab_size is None]} but the checkpoint "
                         f"was trained on {kinds[trained_task.vocab_size is None]}")
    check_model_fits_task(cfg.model, eval_task)
    if eval_task.num_classes != trained_task.num_classes:
        raise ValueError(f"--task {eval_task.name} has {eval_task.num_classes or 'no'} classes but the checkpoint "
                         f"was trained on {trained_task.num_classes or 'none'} (a classifier reads whole series)")
    if eval_task.num_features != trained_task.num_features:
        raise ValueError(f"--task {eval_task.name} has {eval_task.num_features} features per step but the checkpoint "
                         f"was trained on {trained_task.num_features}")
    batches, batch_size = batches or cfg.eval_batches, batch_size or cfg.eval_batch_size
    results = evaluate(model, eval_task, parse_lengths(lengths) if lengths else cfg.task.eval_lengths,
                       EvalPlan(batches, batch_size, seed, device=model_device(model), precision=cfg.dtype))
    try:  # a checkpoint copied without its trainer state still evaluates; it cannot say how training went
        skipped = load_trainer_state(path)["skipped_steps"]
    except ValueError:
        skipped = None
    names = list(next(iter(results.values())))
    typer.echo(f"{'length':>8} " + " ".join(f"{name:>14}" for name in names))
    for length, metrics in results.items():
        typer.echo(f"{length:>8} " + " ".join(f"{metrics[name]:>14.4f}" for name in names))
    typer.echo(f"skipped steps in training (non-finite loss or gradient): "
               f"{skipped if skipped is not None else 'unknown (the checkpoint has no trainer.pt)'}")
    split_name = getattr(eval_task.options, "split", None)
    out = out or default_eval_path(path, eval_task.name, split if split else None, seed)
    out.write_text(json.dumps({"task": eval_task.name, "split": split_name,
                               "checkpoint": str(path), "skipped_steps": skipped, "seed": seed, "batches": batches,
                               "batch_size": batch_size,
                               "results": {str(k): v for k, v in results.items()}}, indent=2))
    typer.echo(str(out))


def metric_text(name: str, value: Any) -> str:
    """One evaluation metric for the terminal: a number, or a list of them (by position; None where a span scored
    nothing) in brackets."""
    if isinstance(value, list):
        return f"{name} [" + " ".join("-" if v is None else f"{v:.4g}" for v in value) + "]"
    return f"{name} {value:.4f}"


def default_eval_path(checkpoint: Path, task: str, split: str | None, seed: int) -> Path:
    """Where `titans eval` writes by default: beside the run (checkpoints are pruned as training goes on), named by
    task, split, seed and step, so that evaluations of one checkpoint on other data do not overwrite each other
    (one with other lengths or batches replaces the last: the file records them)."""
    from .train.checkpoint import RUN_MARKER, checkpoint_step, list_checkpoints

    checkpoint = checkpoint.resolve()  # `.` or `step_N` alone have no parents to look at
    run_dir = checkpoint.parent.parent  # run/checkpoints/step_N
    name = f"eval_{task}" + (f"_{split}" if split else "") + (f"_seed{seed}" if seed else "")
    if (run_dir / RUN_MARKER).is_file() and checkpoint in list_checkpoints(run_dir):
        return run_dir / f"{name}_step{checkpoint_step(checkpoint)}.json"
    return checkpoint / f"{name}.json"  # a checkpoint folder on its own, or one the user named


def model_device(model: Any):
    return next(model.parameters()).device


@app.command()
@friendly
def generate(
    ckpt: Path = typer.Argument(..., help="Checkpoint directory, or a run directory (its latest checkpoint)."),
    prompt: str = typer.Option(..., help="Prompt: text for language models (byte-level, or through the tokenizer of "
                                         "their token shards), else space-separated token ids."),
    max_new_tokens: int = typer.Option(64, min=0),
    temperature: float = typer.Option(0.8, min=0.0, help="0 is greedy."),
    top_k: int | None = typer.Option(None, min=1),
    top_p: float | None = typer.Option(None, min=0.0, max=1.0),
    seed: int = typer.Option(0, help="Sampling seed."),
    max_prompt_tokens: int | None = typer.Option(
        None, min=1, help="Longest prompt accepted (default: the longest length the model was evaluated at)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto."),
    decode: str = typer.Option("dynamic", help="The one-token step: dynamic (the model's own state), compiled (the "
                                               "same through torch.compile: faster per token after a compile of a "
                                               "minute or more), static (in fixed-shape buffers) or graph (static, "
                                               "replayed from CUDA graphs; --device cuda)."),
) -> None:
    """Continue a prompt with a trained language model (token by token through its constant-size state)."""
    import torch

    _, cfg, task, model = load_for_inference(ckpt, device)
    if task.vocab_size is None:
        raise ValueError(f"checkpoint {ckpt} is a {cfg.task.name} forecaster, not a language model")
    codec = task.text_codec()  # the task says what its ids are (bytes, a tokenizer's), not the vocabulary size
    if codec is not None:
        ids = codec.encode(prompt)
    else:
        try:
            ids = [int(token) for token in prompt.split()]
        except ValueError:
            raise ValueError(f"--prompt must be space-separated token ids for a model with vocab_size "
                             f"{cfg.model.vocab_size}, got {prompt!r}") from None
    if not ids:
        raise ValueError("--prompt is empty")
    limit = max_prompt_tokens or max(cfg.task.train_length, *cfg.task.eval_lengths)
    if len(ids) > limit:
        raise ValueError(f"--prompt has {len(ids)} tokens, longer than allowed ({limit}); raise --max-prompt-tokens")
    if min(ids) < 0 or max(ids) >= cfg.model.vocab_size:
        raise ValueError(f"--prompt token ids must lie in [0, {cfg.model.vocab_size})")
    generator = torch.Generator(device=model_device(model)).manual_seed(seed)
    tokens = model.generate(torch.tensor([ids], device=model_device(model)), max_new_tokens, temperature, top_k,
                            top_p, generator=generator, decode=decode)
    new = tokens[0, len(ids):].tolist()
    typer.echo(codec.decode(new) if codec is not None else " ".join(map(str, new)))


@app.command()
@friendly
def export(
    ckpt: Path = typer.Argument(..., help="Checkpoint directory, or a run directory (its latest checkpoint)."),
    out: Path = typer.Argument(..., help="Directory for config.json, model.safetensors and the tokenizer, if any "
                                         "(created if needed)."),
    force: bool = typer.Option(False, help="Replace a model already saved in OUT (other files there stay)."),
) -> None:
    """Turn a training checkpoint into a pretrained model directory: TitansLM.from_pretrained(OUT) loads it, and so
    does transformers' AutoModelForCausalLM.from_pretrained(OUT) after `import titans.hf`; a model trained on token
    shards gets its tokenizer beside it (AutoTokenizer.from_pretrained(OUT)). Its path is the last line."""
    from .train.export import export_checkpoint

    typer.echo(str(export_checkpoint(ckpt, out, force)))


@app.command()
@friendly
def recipes(
    root: Path | None = typer.Argument(None, help="A directory of recipes (default: configs/recipes)."),
    out: Path | None = typer.Option(None, help="Also write the table as JSON here."),
) -> None:
    """The training recipes: the paper's model sizes (and tiny CPU versions) with their parameters, tokens per step,
    steps and tokens in all, counted from the YAML files (nothing trained, no data needed)."""
    from .train.recipes import recipe_files, summarise

    rows = [summarise(path) for path in recipe_files(root)]
    typer.echo(f"{'recipe':<34} {'parameters':>12} {'non-embedding':>14} {'tokens/step':>12} {'steps':>7} "
               f"{'tokens':>9} {'lr':>8}")
    for r in rows:
        params = f"{r['parameters'] / 1e6:.1f}M" if r["parameters"] is not None else "(shards')"
        typer.echo(f"{Path(r['recipe']).parent.name + '/' + Path(r['recipe']).name:<34} {params:>12} "
                   f"{r['non_embedding_parameters'] / 1e6:>13.1f}M {r['tokens_per_step']:>12,} {r['steps']:>7} "
                   f"{r['tokens'] / 1e9:>8.2f}B {r['lr']:>8g}")
    if out is not None:
        out.write_text(json.dumps({"command": "titans recipes" + (f" {root}" if root else ""), "recipes": rows},
                                  indent=2))
        typer.echo(str(out))


@app.command()
@friendly
def demo(
    out: Path = typer.Option(Path("runs/demo"), help="Output directory."),
    force: bool = typer.Option(False, help="Delete an existing output directory (made by titans) first."),
    configs: list[Path] | None = typer.Option(None, help="Training configs (default: configs/demo/*.yaml)."),
    jobs: int | None = typer.Option(None, min=1, help="Runs at once (default: one per config, at most one "
                                                         "per core)."),
    quiet: bool = typer.Option(False, help="No progress bars."),
) -> None:
    """Train a Titans model and the SWA baseline on a needle task, test at 1-8x the training length.

    Prints the table, writes demo.png and demo.json to --out; the JSON's path is the last line.
    """
    from .train.demo import run_demo

    typer.echo(str(run_demo(out, configs, jobs=jobs, quiet=quiet, force=force)))


@data_app.command("prepare")
@friendly
def data_prepare(
    inputs: list[str] = typer.Argument(..., help="Text, JSON Lines (.jsonl) and Parquet files, directories (read "
                                                 "recursively) or globs; a directory a Hugging Face dataset was saved "
                                                 "to (the datasets extra)."),
    out: Path = typer.Option(..., help="The shard directory to write (new, or empty)."),
    vocab_size: int | None = typer.Option(None, help="Train a byte-level BPE tokenizer of this many tokens here."),
    tokenizer: Path | None = typer.Option(None, help="Or use this tokenizer.json (or a tokenizer directory holding "
                                                     "one)."),
    eot_token: str | None = typer.Option(None, help="The document separator of a --tokenizer (default: its "
                                                    "eos_token, or a known end-of-text token)."),
    val_fraction: float = typer.Option(0.01, help="Share of the documents held out for validation (by a hash of "
                                                  "each document's id)."),
    text_field: str = typer.Option("text", help="The JSON field / Parquet or dataset column holding the text."),
    shard_mib: float = typer.Option(64.0, help="Text per unit of work (one shard per split each)."),
    tokenizer_sample_mib: float = typer.Option(256.0, help="Training text the BPE tokenizer learns from, at most."),
    workers: int | None = typer.Option(None, min=1, help="Processes tokenizing at once (default: one per core)."),
    strict: bool = typer.Option(False, help="Refuse binary or undecodable files and malformed records (default: "
                                            "skip and count them)."),
    resume: bool = typer.Option(False, help="Continue an interrupted preparation of --out."),
    force: bool = typer.Option(False, help="Replace a preparation already in --out (one titans made)."),
    quiet: bool = typer.Option(False, help="No progress bar."),
) -> None:
    """Train or load a tokenizer and write token shards for `lm_tokens` (the directory is the last line)."""
    from .data.prepare import PrepareOptions, prepare

    options = PrepareOptions(inputs=list(inputs), vocab_size=vocab_size,
                             tokenizer=None if tokenizer is None else str(tokenizer), eot_token=eot_token,
                             val_fraction=val_fraction, text_field=text_field, shard_mib=shard_mib,
                             tokenizer_sample_mib=tokenizer_sample_mib, strict=strict)
    meta = prepare(options, out, resume=resume, force=force, workers=workers, quiet=quiet)
    _echo_shards(meta)
    typer.echo(str(out))


def _echo_shards(meta) -> None:
    info = meta.tokenizer
    typer.echo(f"tokenizer: {info.vocab_size} tokens ({info.origin}), end of text {info.eot_token!r} = {info.eot_id}, "
               f"sha256 {info.sha256[:16]}...; shards of {meta.dtype}")
    for split, stats in meta.splits.items():
        typer.echo(f"{split}: {stats.documents} documents, {stats.tokens} tokens, {stats.bytes} bytes "
                   f"({stats.bytes / max(stats.tokens, 1):.2f} bytes per token), {len(stats.shards)} shard(s)")
    if meta.skipped:
        typer.echo("skipped: " + ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in meta.skipped.items())
                   + (f" (e.g. {', '.join(meta.skipped_examples[:3])})" if meta.skipped_examples else ""))


@data_app.command("info")
@friendly
def data_info(directory: Path = typer.Argument(..., help="A shard directory (titans data prepare --out).")) -> None:
    """What a shard directory holds: tokenizer, documents, tokens and bytes per split, what was skipped."""
    from .data import read_metadata

    _echo_shards(read_metadata(directory))


@experiment_app.command("list")
@friendly
def experiment_list() -> None:
    """The experiments in configs/experiments, with the number of runs or points of each."""
    from .experiments import expand, experiment_names, load_experiment

    for name in experiment_names():
        exp = load_experiment(name)
        if exp.kind == "train":
            size = f"{len(expand(exp))} training runs"
        else:
            size = f"the runs of {exp.continual.source}" if exp.kind == "continual" else exp.kind
        typer.echo(f"{name:<15} {size:<20} {exp.title}")


@experiment_app.command("run")
@friendly
def experiment_run(
    name: str = typer.Argument(..., help="An experiment in configs/experiments (see `titans experiment list`), or a "
                                         "path to an experiment YAML."),
    quick: bool = typer.Option(False, help="The quick tier: tiny sizes, a few steps (what the test suite runs)."),
    jobs: int | None = typer.Option(None, min=1, help="Runs side by side, one thread each (default: one per core)."),
    results_dir: Path | None = typer.Option(None, help="Where NAME.json goes (default docs/results, or "
                                                       "runs/experiments-quick/results with --quick)."),
    runs_dir: Path | None = typer.Option(None, help="Where the runs go (default runs/experiments, or "
                                                    "runs/experiments-quick with --quick); finished runs are reused."),
    quiet: bool = typer.Option(False, help="No line per finished run."),
    retrain: bool = typer.Option(False, help="Train every run again, even those the results JSON or the runs "
                                             "directory holds finished (after a change to the model's code, which "
                                             "no config shows)."),
    only: str | None = typer.Option(None, help="Train these rows only (comma-separated labels, e.g. 'lmm,lmm alpha "
                                               "1e-2', run ids, or globs over run ids, e.g. '*-dim64-*-s1'); the "
                                               "rest stay as the JSON has them, or pending."),
    no_train: bool = typer.Option(False, "--no-train", help="Train and measure nothing: rewrite the JSON from the runs "
                                                            "it and the runs directory hold (after a default or the "
                                                            "grid changed, the runs and measured points it changed "
                                                            "are marked stale)."),
) -> None:
    """Run an experiment's grid (resumable: finished runs are read back from the runs directory or from the results
    JSON, killed ones continue) and write its JSON after every finished run (its path is the last line)."""
    from .experiments import load_experiment, run_experiment

    exp = load_experiment(name, quick=quick)
    default_root = Path("runs/experiments-quick") if quick else Path("runs/experiments")
    results_dir = results_dir or (default_root / "results" if quick else Path("docs/results"))
    if no_train and only is not None:
        raise ValueError("--no-train trains no rows, so it takes no --only")
    rows = [] if no_train else [row.strip() for row in only.split(",") if row.strip()] if only is not None else None
    typer.echo(str(run_experiment(exp, results_dir, runs_dir or default_root, jobs, quick=quick, quiet=quiet,
                                   retrain=retrain, only=rows)))


@experiment_app.command("report")
@friendly
def experiment_report(
    results_dir: Path = typer.Option(Path("docs/results"), help="The results JSON files."),
    out: Path = typer.Option(Path("docs/RESULTS.md"), help="The report written."),
    readme: Path = typer.Option(Path("README.md"), help="README whose experiments block is rewritten."),
    update_readme: bool = typer.Option(True, "--update-readme/--no-update-readme",
                                       help="Rewrite the README's experiments block (or leave the README alone)."),
) -> None:
    """Write RESULTS.md, a PNG per experiment and the README's results block from the results JSON alone."""
    from .experiments import write_report

    typer.echo(str(write_report(results_dir, out, readme if update_readme else None)))


def main() -> None:
    """Console entry point: usage errors (a missing argument, an unknown option) as one line, exit code 2."""
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as err:
        text = err.format_message()
        if type(err).__name__ != "NoArgsIsHelpError":
            typer.echo(f"error: {one_line(text)}", err=True)
        elif text.strip():  # a bare command asks for its help: rich has printed it already, else it is here
            typer.echo(text, err=True)
        code = err.exit_code
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        code = 1
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
