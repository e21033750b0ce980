"""Training: config, loop (AdamW, warmup + cosine, DDP), checkpoints with exact resume, the demo."""

from .config import OptimConfig, TaskConfig, TrainConfig, load_train_config
from .evaluation import EvalPlan, evaluate
from .loop import Trainer, TrainResult, build_model, build_task, lr_at, setup_distributed, train

__all__ = ["EvalPlan", "OptimConfig", "TaskConfig", "TrainConfig", "TrainResult", "Trainer", "build_model",
           "build_task", "evaluate", "load_train_config", "lr_at", "setup_distributed", "train"]
