"""Text <-> token ids for a model: UTF-8 bytes (the byte-level tasks, vocabulary 256) or a subword tokenizer.

`titans generate`, the lm-eval evaluator and `titans export` read and write text through one of these, picked by
what the model was trained on (`Task.text_codec`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BYTE_VOCAB = 256


class TextCodec(Protocol):
    """`encode(text) -> ids`, `decode(ids) -> text`; `start` is what stands before a text that has nothing before it
    (an empty context, a whole text scored from its first token): a first token needs a position before it."""

    start: list[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def to_bytes(self, ids: Sequence[int]) -> bytes:
        """The UTF-8 text of `ids` (a byte-level model's bytes as they are, so that a stop string is matched in the
        bytes even where they are not whole characters yet)."""
        ...


class ByteCodec:
    """One token per UTF-8 byte. Text that is not valid UTF-8 (a command-line argument's undecodable bytes, carried as
    surrogates) encodes to its original bytes; bytes that do not decode, and ids beyond a byte, decode to U+FFFD."""

    def __init__(self, start: str = "\n"):
        if not start:
            raise ValueError("start must be a non-empty string (an empty context needs a byte to condition on)")
        self.start = self.encode(start)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogateescape"))

    def decode(self, ids: Sequence[int]) -> str:
        return self.to_bytes(ids).decode("utf-8", errors="replace")

    def to_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(i if 0 <= i < BYTE_VOCAB else 0xFF for i in ids)


class TokenizerCodec:
    """A Hugging Face `tokenizers.Tokenizer`; `start` is the end-of-text token, which in training ends the document
    before every document (the shards put it after each one)."""

    def __init__(self, tokenizer: Tokenizer, eot_id: int):
        self.tokenizer, self.eot_id = tokenizer, eot_id
        self.start = [eot_id]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        # special tokens kept: an end-of-text the model wrote is part of what it wrote
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def to_bytes(self, ids: Sequence[int]) -> bytes:
        return self.decode(ids).encode("utf-8")
