"""Data preparation for language models: a subword tokenizer and token shards from local text (`titans data`).

`prepare(PrepareOptions(...), out)` (prepare.py) reads text, JSON Lines, Parquet and Hugging Face datasets directories
(sources.py), trains or loads a tokenizer (tokenizer.py) and writes memory-mapped token shards with their metadata
(shards.py), which the `lm_tokens` task reads. codec.py turns text into a model's token ids and back.
"""

from .shards import ShardMetadata, open_split, read_metadata

__all__ = ["ShardMetadata", "open_split", "read_metadata"]
