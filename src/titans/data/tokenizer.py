"""Subword tokenizers: train a byte-level BPE with Hugging Face `tokenizers`, or load one the user has; hash, EOT, and
the files `transformers.AutoTokenizer` reads.

A tokenizer is identified by the SHA-256 of its canonical JSON (`Tokenizer.to_str()`), which is also the exact text
of the `tokenizer.json` this module writes: `sha256sum tokenizer.json` gives the hash the shards record. Nothing is
fetched: a tokenizer is a file the user has (`tokenizer.json`, or a Hugging Face tokenizer directory holding one) or
one trained here.

`tokenizers` is the `data` extra (`pip install -c constraints.txt -e ".[data]"`); it is imported when first used.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOT_TOKEN = "<|endoftext|>"  # the document separator of the tokenizers trained here (GPT-2's name for it)
# End-of-text tokens of common tokenizers, tried in this order when a loaded tokenizer names none (its
# tokenizer_config.json's eos_token wins): GPT-2 / Llama 3 / Llama 2 and T5 / others.
KNOWN_EOT_TOKENS = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
TOKENIZER_FILE = "tokenizer.json"
MIN_VOCAB = 257  # the 256 byte tokens of a byte-level BPE and the end-of-text token


def tokenizers_module():
    """The `tokenizers` package, or a ValueError saying how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise ValueError('Hugging Face tokenizers is not installed: pip install -c constraints.txt -e ".[data]"') \
            from None
    return tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme: every byte is a token, so any text encodes and decodes back exactly) with
    `vocab_size` tokens, the last merges learnt from `texts`, and the end-of-text token `EOT_TOKEN` (id 0)."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB} (the 256 bytes and the end-of-text token), "
                         f"got {vocab_size}")
    tk = tokenizers_module()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    tokenizer.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT_TOKEN],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json at `path`: the file itself, or the one inside a tokenizer directory."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"tokenizer directory {path.parent} has no {TOKENIZER_FILE} (a sentencepiece "
                             "tokenizer.model alone is not read: save it as a fast tokenizer with transformers first)")
    elif not path.is_file():
        raise ValueError(f"tokenizer {path} does not exist")
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json file or a directory holding one."""
    file = tokenizer_file(path)
    try:
        return tokenizers_module().Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust library raises its own Exception type for a malformed file
        raise ValueError(f"tokenizer {file} is not a Hugging Face tokenizer.json: {' '.join(str(err).split())}") \
            from None


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """SHA-256 of the tokenizer's canonical JSON: equal for equal tokenizers, whatever file they were read from."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> str:
    """Write the canonical JSON to `path` (its SHA-256 is the tokenizer's hash); returns the hash."""
    text = tokenizer.to_str()
    Path(path).write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


def end_of_text(tokenizer: Tokenizer, name: Optional[str] = None, source: Optional[Path] = None) -> tuple[str, int]:
    """(token, id) of the document separator: `name` when given; else the `eos_token` of a tokenizer_config.json
    beside the tokenizer file `source`; else the first of `KNOWN_EOT_TOKENS` the vocabulary holds."""
    candidates: tuple[str, ...] = KNOWN_EOT_TOKENS
    if name is not None:
        candidates = (name,)
    elif source is not None and (source.parent / "tokenizer_config.json").is_file():
        eos = _config_eos(source.parent / "tokenizer_config.json")
        candidates = (eos, *KNOWN_EOT_TOKENS) if eos else KNOWN_EOT_TOKENS
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    if name is not None:
        raise ValueError(f"--eot-token {name!r} is not in the tokenizer's vocabulary")
    raise ValueError(f"the tokenizer has no end-of-text token (none of {', '.join(KNOWN_EOT_TOKENS)}); name the "
                     "token that separates documents with --eot-token")


def _config_eos(path: Path) -> Optional[str]:
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, OSError, AttributeError):
        return None
    if isinstance(eos, dict):  # transformers' AddedToken form
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def vocab_size(tokenizer: Tokenizer) -> int:
    """The number of token ids the tokenizer can emit (added special tokens included): the model's embedding rows."""
    return tokenizer.get_vocab_size(with_added_tokens=True)


def write_transformers_files(tokenizer_json: Path, eot_token: str, directory: Path, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json in `directory`: what
    `transformers.AutoTokenizer.from_pretrained(directory)` loads as a fast tokenizer. The end-of-text token is its
    eos (generation stops there) and bos (what an empty context is conditioned on, as in training, where it ends the
    document before)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TOKENIZER_FILE).write_bytes(Path(tokenizer_json).read_bytes())
    special = {"bos_token": eot_token, "eos_token": eot_token}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
