"""Run directories and checkpoints: safetensors weights + trainer state + the resolved config, written atomically.

Layout of a run directory:

    run_dir/.titans-run                     marker: made by titans, so --force may delete it
    run_dir/config.yaml                     the resolved config of the run
    run_dir/metrics.jsonl                   one JSON record per log / eval line
    run_dir/eval.json                       the final evaluation
    run_dir/checkpoints/step_0000120/       model.safetensors, trainer.pt, config.yaml
                                            (a sharded run, `parallel: fsdp`: sharded/ instead of model.safetensors,
                                            each rank's shards of the model and optimiser in DCP's format, fsdp.py)

A checkpoint is written into a hidden temporary folder and renamed into place (rename is atomic),
so a `step_*` folder is always complete and a process killed at any moment leaves the newest
complete one as the latest. Each step is written once: the state at a step is a deterministic
function of the config, so a second write would only add a window in which it is missing. Under torchrun every rank
writes its part into the one temporary folder (its shards, its carried states) before rank 0 completes and renames it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from ..config import read_yaml_mapping
from ..io.state import load_state, save_state
from .config import TrainConfig, load_train_config, saved_train_dict

RUN_MARKER = ".titans-run"
CHECKPOINT_FILES = ("model.safetensors", "trainer.pt", "config.yaml")  # what a checkpoint folder holds
# ... and, in a run that carries its state across windows (`carry_windows`), the states its next step starts from (one
# file per rank under torchrun: each rank carries the states of its own rows)
CARRIED_FILE = "carried.safetensors"
SHARDED_DIR = "sharded"  # a sharded run's model and optimiser shards (fsdp.py)


def carried_file(rank: int, world: int) -> str:
    return CARRIED_FILE if world == 1 else f"carried.rank{rank}.safetensors"


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint folder: its weights, whole or sharded, are there."""
    return (Path(path) / CHECKPOINT_FILES[0]).is_file() or (Path(path) / SHARDED_DIR / ".metadata").is_file()
TRAINER_STATE_KEYS = ("step", "optimizer", "rng", "train_seconds", "skipped_steps")


def check_run_dir(run_dir: Path, force: bool = False, resume: bool = False, resumable: bool = True) -> None:
    """Whether `prepare_run_dir` may go ahead; touches nothing, so a command checks this, then everything else
    (config, device, data), and only then prepares: a run refused for another reason loses nothing.

    An existing non-empty folder is never touched without `force`, and `force` deletes only a folder
    that titans made (it holds the run marker): `--force --out ~` must not wipe a home directory.
    """
    run_dir = Path(run_dir)
    if resume:
        if not (run_dir / RUN_MARKER).is_file():
            raise ValueError(f"--resume: {run_dir} is not a titans run directory")
        return
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        if not force:
            raise ValueError(f"run directory {run_dir} already exists; pass --force to overwrite it"
                             + (" or --resume to continue it" if resumable else ""))
        if not (run_dir / RUN_MARKER).is_file():
            raise ValueError(f"--force: {run_dir} was not made by titans (no {RUN_MARKER} in it); "
                             "refusing to delete it")


def prepare_run_dir(run_dir: Path, force: bool = False, resume: bool = False, resumable: bool = True) -> None:
    """Create `run_dir` for a new run (with `force`, after deleting the titans run there), or check it for
    `resume` (`resumable`: whether the command has one); `check_run_dir` says what is refused."""
    check_run_dir(run_dir, force, resume, resumable)
    run_dir = Path(run_dir)
    if resume:
        return
    if run_dir.is_dir() and any(run_dir.iterdir()):  # a titans run, and `force`: check_run_dir said so
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_MARKER).touch()


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_dir(run_dir)
    found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and is_checkpoint(p)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name[5:])


def _write_synced(path: Path, write) -> None:
    write(path)
    with open(path, "rb") as f:  # flush to disk before the rename makes the checkpoint visible
        os.fsync(f.fileno())


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, trainer_state: dict[str, Any],
                    config: TrainConfig, keep: int = 2, carried: Any = None, rank: int = 0, world: int = 1,
                    write_shards: Callable[[Path], None] | None = None) -> Path:
    """Write checkpoint `step` (unless it exists) and keep only the newest `keep` checkpoints. `carried`: the
    recurrent states the next step starts from (one per micro-batch), where the run carries them across windows.

    Under torchrun every rank calls this: each writes its carried states and, with `write_shards` (a collective that
    writes the model's and optimiser's shards into the folder it is given), its shards; rank 0 then writes the rest
    (`model` whole, unless sharded) and renames the folder into place."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:07d}"
    if not final.is_dir():
        tmp = root / f".tmp_{final.name}" if world > 1 else root / f".tmp_{final.name}_{os.getpid()}"
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp_*"):  # left behind by a writer that was killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier(world)
        if write_shards is not None:
            write_shards(tmp / SHARDED_DIR)
        if carried is not None:
            _write_synced(tmp / carried_file(rank, world), lambda p: save_state(carried, p))
        _barrier(world)
        if rank == 0:
            weights, trainer, config_file = (tmp / name for name in CHECKPOINT_FILES)
            if write_shards is None:
                _write_synced(weights, lambda p: save_model(model, str(p)))
            _write_synced(trainer, lambda p: torch.save(trainer_state, p))
            _write_synced(config_file, config.to_yaml)
            os.rename(tmp, final)
    if rank == 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            # Only what the checkpoint wrote: a file a user put there (an evaluation) stays, in a folder that is
            # no longer a checkpoint (it lacks the weights).
            for name in CHECKPOINT_FILES:
                (old / name).unlink(missing_ok=True)
            for carried_states in old.glob("carried*.safetensors"):
                carried_states.unlink()
            shutil.rmtree(old / SHARDED_DIR, ignore_errors=True)
            with contextlib.suppress(OSError):
                old.rmdir()
    _barrier(world)
    return final


def resolve_checkpoint(path: Path) -> Path:
    """Accept a checkpoint folder or a run folder (then its latest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if is_checkpoint(path):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"{path} is neither a checkpoint nor a run directory with checkpoints")
    return latest


def load_checkpoint_config(path: Path) -> TrainConfig:
    config_path = Path(path) / "config.yaml"
    if not config_path.is_file():
        raise ValueError(f"checkpoint {path} has no config.yaml")
    try:
        return load_train_config(data=saved_train_dict(read_yaml_mapping(config_path)))
    except ValueError as err:
        raise ValueError(f"checkpoint {path} has an invalid config.yaml: {err}") from None


def load_weights(path: Path, model: nn.Module) -> None:
    """Load the checkpoint's weights into a whole `model` (one process): model.safetensors, or the shards of a sharded
    run gathered; ValueError when they are unreadable or do not fit the model."""
    weights = Path(path) / "model.safetensors"
    if not weights.is_file() and (Path(path) / SHARDED_DIR / ".metadata").is_file():
        from .fsdp import load_sharded_weights

        try:
            load_sharded_weights(Path(path) / SHARDED_DIR, model)
        except (RuntimeError, OSError, ValueError, KeyError) as err:
            raise ValueError(f"checkpoint {path}: its shards are corrupt or do not match the model: "
                             f"{str(err).strip().splitlines()[0][:300]}") from None
        return
    if not weights.is_file():
        raise ValueError(f"checkpoint {path} has no model.safetensors")
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"checkpoint {path} is corrupt or does not match the model: "
                         f"{str(err).strip().splitlines()[0]}") from None
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")


def load_carried(path: Path, device: torch.device, rank: int = 0, world: int = 1) -> Any:
    """The carried states of this rank a checkpoint holds (`save_checkpoint`'s `carried`), on `device`; None where it
    holds none (a step that starts fresh windows)."""
    saved = sorted(p.name for p in Path(path).glob("carried*.safetensors"))
    if not saved:
        return None
    file = Path(path) / carried_file(rank, world)
    if not file.is_file():
        raise ValueError(f"checkpoint {path} holds carried states for {len(saved)} process(es) ({', '.join(saved)}), "
                         f"none for rank {rank} of {world}: a run that carries its state across windows resumes on "
                         "as many ranks as it was saved on")
    return load_state(file, str(device))


def load_trainer_state(path: Path) -> dict[str, Any]:
    """trainer.pt (plain tensors and containers only: loaded with weights_only=True)."""
    try:
        state = torch.load(Path(path) / "trainer.pt", weights_only=True, map_location="cpu")  # resumable on CPU
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise ValueError(f"checkpoint {path} has an unreadable trainer.pt: "
                         f"{str(err).strip().splitlines()[0]}") from None
    if not isinstance(state, dict) or any(key not in state for key in TRAINER_STATE_KEYS):
        raise ValueError(f"checkpoint {path}: trainer.pt lacks the trainer state ({', '.join(TRAINER_STATE_KEYS)})")
    return state
