"""A training checkpoint as a pretrained model directory (`titans export`): what `TitansLM.from_pretrained` and, after
`import titans.hf`, `transformers.AutoModelForCausalLM.from_pretrained` load, and for a model trained on token shards
the tokenizer beside it, so that `AutoTokenizer.from_pretrained` loads its pair.

The weights come from the checkpoint whatever its format (one safetensors file, or the shards of an FSDP run, which are
gathered here into one model, `checkpoint.load_weights`). The end-of-text token goes into config.json and
generation_config.json as bos and eos: generation through transformers stops at a document's end.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data.tokenizer import TOKENIZER_FILE, write_transformers_files
from ..models import TitansLM
from .checkpoint import RUN_MARKER, resolve_checkpoint
from .loop import load_trained

MODEL_FILES = ("config.json", "model.safetensors")
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def export_checkpoint(ckpt: Path, out: Path, force: bool = False) -> Path:
    """Write the model of checkpoint `ckpt` (or of a run directory's latest) into `out`; a model already saved there
    is replaced only with `force` (other files stay). Returns `out`."""
    path = resolve_checkpoint(ckpt)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory")
    if out.resolve() == path.resolve() or (out / RUN_MARKER).is_file() or (out / "trainer.pt").is_file():
        # A model.safetensors there would turn a run directory into a "checkpoint" for eval, generate and --resume.
        raise ValueError(f"{out} is a run or checkpoint directory; export to a directory of its own")
    if not force and any((out / name).exists() for name in MODEL_FILES):
        raise ValueError(f"{out} already holds a saved model; pass --force to replace it")
    _, cfg, task, model = load_trained(path, "cpu")
    if not isinstance(model, TitansLM):
        raise ValueError(f"checkpoint {path} is a {cfg.task.name} forecaster, not a language model; only language "
                         "models export")
    codec = task.text_codec()  # before anything is written: a tokenizer changed since training is refused here
    model.save_pretrained(out, overwrite=force)
    for name in TOKENIZER_FILES:  # a tokenizer of an earlier export into `out` is not this model's
        (out / name).unlink(missing_ok=True)
    eot = getattr(codec, "eot_id", None)
    if eot is not None:
        meta = task.metadata.tokenizer
        write_transformers_files(Path(task.options.data) / meta.file, meta.eot_token, out,
                                 model_max_length=max(cfg.task.train_length, *cfg.task.eval_lengths))
        config = json.loads((out / "config.json").read_text())
        config.update(bos_token_id=eot, eos_token_id=eot)  # transformers' keys; TitansLM reads only the titans section
        (out / "config.json").write_text(json.dumps(config, indent=2))
        (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": eot}, indent=2))
    return out
