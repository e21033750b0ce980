"""Checkpoints: safetensors weights + optimizer/RNG/step state + the resolved config, written atomically.

Layout: run_dir/checkpoints/step_000123/{model.safetensors, trainer.pt, config.yaml} and
run_dir/checkpoints/latest (the name of the newest complete checkpoint). A checkpoint is written
into a temporary folder and renamed into place, and `latest` is replaced atomically, so a process
killed at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from .config import TrainConfig, load_train_config


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, trainer_state: dict[str, Any], config: TrainConfig,
                    keep: int = 2) -> Path:
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(trainer_state, tmp / "trainer.pt")
    config.to_yaml(tmp / "config.yaml")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / f".latest_{os.getpid()}"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    for old in sorted(root.glob("step_*"))[:-keep]:  # keep the newest `keep` checkpoints
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    pointer = checkpoint_dir(run_dir) / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_dir(run_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def resolve_checkpoint(path: Path) -> Path:
    """Accept a checkpoint folder or a run folder (its latest checkpoint)."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"{path} is neither a checkpoint nor a run directory with checkpoints")
    return latest


def load_checkpoint_config(path: Path) -> TrainConfig:
    config_path = Path(path) / "config.yaml"
    if not config_path.is_file():
        raise ValueError(f"checkpoint {path} has no config.yaml")
    return load_train_config(config_path)


def load_weights(path: Path, model: nn.Module) -> None:
    weights = Path(path) / "model.safetensors"
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"checkpoint {path} is corrupt or does not match the model: {str(err).splitlines()[0]}") from None
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")


def load_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return torch.load(Path(path) / "trainer.pt", weights_only=False)
    except (OSError, RuntimeError, EOFError) as err:
        raise ValueError(f"checkpoint {path} has an unreadable trainer.pt: {str(err).splitlines()[0]}") from None
