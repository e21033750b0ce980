"""Token shards on disk: the layout `titans data prepare` writes and the `lm_tokens` task memory-maps.

    DIR/metadata.json          written last: its presence says the preparation is complete (`ShardMetadata`)
    DIR/tokenizer.json         the tokenizer the shards were made with (its SHA-256 is metadata's tokenizer.sha256)
    DIR/train/000000.bin ...   raw little-endian uint16 token ids (uint32 where the vocabulary exceeds 65536)
    DIR/val/000000.bin ...     each document's tokens followed by the end-of-text token
    DIR/.prepare/              while it runs: the plan and a record per finished unit (what --resume reads)

A shard is the tokens of one unit of work (a group of source files or a piece of a large one) in one split: shards
hold whole documents, and no document is in both splits. `bytes` in the metadata is the UTF-8 length of the documents'
text, so a mean loss per token converts to bits per byte (`bytes_per_token`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from ..config import Config

FORMAT = "titans-tokens"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
SPLITS = ("train", "val")
Split = Literal["train", "val"]


def token_dtype(vocab: int) -> np.dtype:
    """uint16 where every id fits (vocabularies up to 65536), else uint32; little-endian on every machine."""
    return np.dtype("<u2") if vocab <= 2**16 else np.dtype("<u4")


class ShardFile(Config):
    file: str  # relative to the shard directory
    tokens: int = Field(ge=1)


class SplitStats(Config):
    documents: int = Field(0, ge=0)
    tokens: int = Field(0, ge=0)  # end-of-text tokens included
    bytes: int = Field(0, ge=0)  # UTF-8 bytes of the documents' text
    shards: list[ShardFile] = Field(default_factory=list)


class TokenizerInfo(Config):
    file: str = "tokenizer.json"
    sha256: str
    vocab_size: int = Field(ge=1)
    eot_token: str
    eot_id: int = Field(ge=0)
    origin: str  # "trained here (...)" or the file it was loaded from


class ShardMetadata(Config):
    """metadata.json: what the shards hold and how they were made. Read strictly (an unknown field is refused)."""

    format: Literal["titans-tokens"] = FORMAT
    version: int = Field(FORMAT_VERSION, ge=1)
    tokenizer: TokenizerInfo
    dtype: Literal["uint16", "uint32"]
    val_fraction: float = Field(gt=0, lt=1)
    text_field: str
    splits: dict[Split, SplitStats]
    skipped: dict[str, int] = Field(default_factory=dict)  # documents skipped, by reason
    skipped_examples: list[str] = Field(default_factory=list)
    inputs: list[str] = Field(default_factory=list)  # the paths, directories and globs as given
    sources: int = Field(0, ge=0)  # files (and dataset splits) they named


def read_metadata(directory: str | Path) -> ShardMetadata:
    """The metadata of a complete shard directory; a ValueError naming what is wrong otherwise."""
    directory = Path(directory)
    path = directory / METADATA_FILE
    if not directory.is_dir():
        raise ValueError(f"shard directory {directory} does not exist (make it with `titans data prepare`)")
    if not path.is_file():
        unfinished = (directory / ".prepare").is_dir()
        raise ValueError(f"{directory} holds no {METADATA_FILE}: " + (
            "its preparation did not finish (rerun `titans data prepare` with --resume)" if unfinished
            else "not a token shard directory (make one with `titans data prepare`)"))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if isinstance(data, dict) and isinstance(data.get("version"), int) and data["version"] > FORMAT_VERSION:
        raise ValueError(f"{path} is in shard format version {data['version']}, newer than this library reads "
                         f"({FORMAT_VERSION}); upgrade titans")
    try:
        return ShardMetadata.from_dict(data, _path=str(path))
    except ValueError as err:
        raise ValueError(f"{path} is not titans shard metadata: {err}") from None


@lru_cache(maxsize=16)
def _memmaps(directory: str, split: str, stamp: tuple) -> tuple[np.ndarray, ...]:
    """The split's shards, memory-mapped read-only (cached per process; `stamp`, the metadata's mtime and size, makes
    a re-prepared directory open anew)."""
    meta = read_metadata(directory)
    dtype = np.dtype("<u2") if meta.dtype == "uint16" else np.dtype("<u4")
    maps = []
    for shard in meta.splits[split].shards:
        path = Path(directory) / shard.file
        if not path.is_file():
            raise ValueError(f"shard {path} is missing (metadata.json lists it)")
        if path.stat().st_size != shard.tokens * dtype.itemsize:
            raise ValueError(f"shard {path} holds {path.stat().st_size} bytes, metadata.json says {shard.tokens} "
                             f"{meta.dtype} tokens: the shard directory is damaged; prepare it again")
        maps.append(np.memmap(path, dtype=dtype, mode="r"))
    return tuple(maps)


def open_split(directory: str | Path, split: str) -> tuple[np.ndarray, ...]:
    """Every shard of `split`, memory-mapped (read-only, in order)."""
    path = Path(directory) / METADATA_FILE
    stat = path.stat()
    return _memmaps(str(Path(directory).resolve()), split, (stat.st_mtime_ns, stat.st_size))
