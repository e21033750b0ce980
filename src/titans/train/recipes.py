"""The recipes (configs/recipes): training configs for the paper's model sizes and their tiny CPU versions, summarised
without their data (`titans recipes`): parameters, tokens per step and in all, the schedule."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ..config import read_yaml_mapping, shipped_configs
from ..models import TitansLM
from .config import TrainConfig


def recipe_files(root: Optional[Path] = None) -> list[Path]:
    """Every recipe YAML under `root` (default: configs/recipes of the working directory or of this checkout)."""
    if root is None:
        found = shipped_configs("recipes/tiny")
        if found is None:
            raise ValueError("no configs/recipes here: run from a titans checkout, or pass the recipes directory")
        root = found.parent
    files = sorted(Path(root).rglob("*.yaml"))
    if not files:
        raise ValueError(f"{root} holds no recipe YAML files")
    return files


def summarise(path: Path) -> dict[str, Any]:
    """A recipe's numbers, read from its YAML without building its task (its shards need not exist here). The
    parameters are counted on the meta device (nothing allocated) at the recipe's vocabulary; a recipe that takes its
    vocabulary from the shards counts none for the embedding (`vocab_size` None)."""
    data = read_yaml_mapping(path)
    cfg = TrainConfig.from_dict(data, _path=str(path))
    vocab = (data.get("model") or {}).get("vocab_size")
    with torch.device("meta"):
        model = TitansLM(cfg.model)
    embedding = model.embed.weight.numel() * (1 if cfg.model.tie_embeddings else 2)
    tokens_per_step = cfg.batch_size * cfg.task.train_length
    return {"recipe": str(path), "name": cfg.run_name, "variant": cfg.model.variant, "vocab_size": vocab,
            "parameters": model.num_parameters() if vocab is not None else None,
            "non_embedding_parameters": model.num_parameters() - embedding,
            "dim": cfg.model.dim, "depth": cfg.model.depth, "heads": cfg.model.heads,
            "train_length": cfg.task.train_length, "batch_size": cfg.batch_size, "grad_accum": cfg.optim.grad_accum,
            "tokens_per_step": tokens_per_step, "steps": cfg.steps, "tokens": tokens_per_step * cfg.steps,
            "lr": cfg.optim.lr, "warmup_steps": cfg.optim.warmup_steps, "min_lr_ratio": cfg.optim.min_lr_ratio,
            "weight_decay": cfg.optim.weight_decay, "decay_gates": cfg.optim.decay_gates}
