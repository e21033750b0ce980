"""Scoring and generation of text over a `TitansLM`: the logic behind lm-evaluation-harness's three request types.

`titans.harness` is the thin lm-eval layer over `TextEvaluator`, which holds the logic and documents it (token-level
scoring, what stands before an empty context, piecewise reading that carries the state, greedy or sampled generation
cut at the first `until` string): this module does not import lm_eval, so it is tested without the `eval` extra.

Text becomes token ids through the model's codec (`titans.data.codec`): UTF-8 bytes for a byte-level model (vocab 256,
`ByteLevelEvaluator`), its subword tokenizer for a model exported with one (`titans export` of an `lm_tokens` run writes
tokenizer.json beside the weights; `TextEvaluator.from_pretrained` picks the codec by that file). The model is recurrent
with a state of bounded size, so nothing is windowed: every text is read whole, in pieces of `piece_len` tokens that
carry the state (the pieces bound the activations' memory; the scores equal one call over the whole text).

- `loglikelihood`: the continuation's tokens scored after the context's tokens; `is_greedy` when each continuation
  token is the argmax at its position. Byte-level, the two strings' bytes are simply joined. With a subword tokenizer
  the pair is encoded as lm-eval's Hugging Face models do: whitespace that ends the context moves to the continuation,
  the joined text is encoded whole, and the continuation is the tokens after the context's own encoding (a tokenizer
  merges across the seam). An empty context conditions on the codec's `start`: a newline byte (`prefix`, byte-level)
  or the end-of-text token (subword, what ends the document before every document in training).
- `loglikelihood_rolling`: the whole text after `start` (every token of the text is scored, once).
- `generate_until`: one token at a time through the state, greedy by default (`temperature`, `top_k`, `top_p`
  sample when `do_sample` is true), stopping at the first `until` string (cut off) or after `max_gen_toks` tokens;
  the output is decoded with errors="replace".

`max_length` keeps only the last `max_length` tokens of each context (default: all of it; the state carries any
length). Requests run one at a time: batching texts of different lengths would need padding, and the memory would
read the pads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.codec import BYTE_VOCAB, ByteCodec, TextCodec, TokenizerCodec
from .lm import State, TitansLM, sample_next

__all__ = ["BYTE_VOCAB", "GEN_KWARGS", "ByteLevelEvaluator", "TextEvaluator", "cut_at_first_stop"]

GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
DEFAULT_MAX_GEN_TOKS = 256


def cut_at_first_stop(out: bytes, until: list[bytes]) -> bytes:
    """`out` up to (not including) the earliest occurrence of any stop string; all of it when none occurs."""
    hits = [at for at in (out.find(stop) for stop in until) if at >= 0]
    return out[:min(hits)] if hits else out


def _integer(name: str, value: Any, minimum: int) -> int:
    """An integer argument; lm-eval's `model_args` and `gen_kwargs` strings may carry it as text ("5")."""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def saved_codec(directory: Union[str, Path]) -> Optional[TokenizerCodec]:
    """The subword codec saved beside a model (`titans export` of an `lm_tokens` run: tokenizer.json, and the end of
    text as tokenizer_config.json's eos_token); None for a model saved without one (byte-level)."""
    from ..data.tokenizer import TOKENIZER_FILE, load_tokenizer

    directory = Path(directory)
    if not (directory / TOKENIZER_FILE).is_file():
        return None
    tokenizer = load_tokenizer(directory)
    eos = json.loads((directory / "tokenizer_config.json").read_text()).get("eos_token") \
        if (directory / "tokenizer_config.json").is_file() else None
    eot_id = tokenizer.token_to_id(eos) if isinstance(eos, str) else None
    if eot_id is None:
        raise ValueError(f"{directory}: tokenizer_config.json names no eos_token in the tokenizer's vocabulary (the "
                         "token that separates documents); export the model again with `titans export`")
    return TokenizerCodec(tokenizer, eot_id)


class TextEvaluator:
    """A `TitansLM` answering loglikelihood, rolling loglikelihood and generate_until on text through `codec`.

    `max_length`: keep only the last `max_length` tokens of each context (None: all). `piece_len`: tokens read per
    forward call. `seed`: the sampling generator's seed (used only when a request samples).
    """

    def __init__(self, model: TitansLM, codec: TextCodec, max_length: Optional[int] = None, piece_len: int = 1024,
                 seed: int = 0):
        if not isinstance(model, TitansLM):
            raise ValueError(f"model must be a TitansLM, got {type(model).__name__}")
        self.model, self.codec = model.eval(), codec
        self.device = model.embed.weight.device
        self.max_length = None if max_length is None else _integer("max_length", max_length, 1)
        self.piece_len = _integer("piece_len", piece_len, 1)
        self.prefix = list(codec.start)
        self.generator = torch.Generator(device=self.device).manual_seed(_integer("seed", seed, 0))

    @classmethod
    def from_pretrained(cls, pretrained: str, device: Optional[str] = None, dtype: Optional[str] = None,
                        **options: Any) -> "TextEvaluator":
        """Load a saved model (`save_pretrained` or `titans export` output) onto `device` (default: cuda if
        available, else cpu), cast to the floating dtype named by `dtype` (e.g. "float32"; default: as saved), with
        the tokenizer saved beside it, or byte-level (a `ByteLevelEvaluator`) where there is none. `options` are the
        constructor's (`max_length`, `piece_len`, `seed`; `prefix` for a byte-level model)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must name a torch device (e.g. cpu, cuda:0), got {device!r}") from None
        cast = None
        if dtype is not None:
            cast = getattr(torch, str(dtype), None)
            if not isinstance(cast, torch.dtype) or not cast.is_floating_point:
                raise ValueError(f"dtype must name a floating torch dtype (e.g. float32), got {dtype!r}")
        model = TitansLM.from_pretrained(str(pretrained), device=str(device))
        model = model if cast is None else model.to(cast)
        codec = saved_codec(pretrained) if cls is TextEvaluator else None
        if codec is None:
            return ByteLevelEvaluator(model, **options)
        if "prefix" in options:
            raise ValueError("prefix is for byte-level models; this one has a tokenizer, whose end-of-text token "
                             "stands before an empty context")
        return cls(model, codec, **options)

    # -- reading ------------------------------------------------------------------------------------------------

    def _context(self, tokens: list[int]) -> list[int]:
        """The context's tokens, the last `max_length` of them; the codec's start when there are none."""
        if self.max_length is not None:
            tokens = tokens[-self.max_length:]
        return tokens or list(self.prefix)

    def _read(self, tokens: list[int]) -> Iterator[tuple[int, Tensor, State]]:
        """Feed `tokens` from a fresh state in pieces of `piece_len`, carrying the state: yields each piece's start,
        its logits `[piece, vocab]` and the state after it. The logits equal one call over all the tokens
        (`TitansLM.forward` is recurrent)."""
        seq = torch.tensor(tokens, dtype=torch.long, device=self.device)
        state: Optional[State] = None
        for start in range(0, len(tokens), self.piece_len):
            logits, state = self.model(seq[None, start:start + self.piece_len], state)
            yield start, logits[0], state

    # -- scoring ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _score(self, tokens: list[int], n_scored: int) -> tuple[float, bool]:
        """Sum of log-probs (float64) of the last `n_scored` tokens given those before, and whether each is the
        argmax at its position."""
        if n_scored == 0:
            return 0.0, True
        if n_scored >= len(tokens):
            raise ValueError("every scored token needs a token before it")
        inputs, targets = tokens[:-1], torch.tensor(tokens[1:], dtype=torch.long, device=self.device)
        first = len(inputs) - n_scored  # input positions from here on predict a scored token
        total, greedy = 0.0, True
        for start, logits, _ in self._read(inputs):
            lo = max(first, start)
            if lo >= start + len(logits):
                continue
            scored, target = logits[lo - start:], targets[lo:start + len(logits)]
            logp = F.log_softmax(scored.double(), dim=-1)
            total += logp.gather(-1, target[:, None]).sum().item()
            greedy = greedy and bool((scored.argmax(-1) == target).all())
        return total, greedy

    def loglikelihood(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[float, bool]]:
        """For each (context, continuation): the continuation's log-prob after the context, and whether it is the
        greedy continuation."""
        out = []
        for context, continuation in pairs:
            context_ids, continuation_ids = self._pair(context, continuation)
            out.append(self._score(self._context(context_ids) + continuation_ids, len(continuation_ids)))
        return out

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens), byte-level joined as they are; subword as lm-eval's Hugging Face
        models encode a pair (the module docstring)."""
        if isinstance(self.codec, ByteCodec):
            return self.codec.encode(context), self.codec.encode(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, context_ids = self.codec.encode(context + continuation), self.codec.encode(context)
        return context_ids, whole[len(context_ids):]

    def loglikelihood_rolling(self, texts: Iterable[str]) -> list[float]:
        """For each text: the log-prob of all its bytes after the prefix."""
        out = []
        for text in texts:
            body = self.codec.encode(text)
            out.append(self._score(self.prefix + body, len(body))[0])
        return out

    # -- generation ---------------------------------------------------------------------------------------------

    @staticmethod
    def generation_options(gen_kwargs: Optional[dict]) -> dict[str, Any]:
        """lm-eval's generation arguments, checked: the stop strings as UTF-8, the token budget and the sampler's
        arguments (temperature 0, greedy, unless `do_sample`)."""
        gen_kwargs = dict(gen_kwargs or {})
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if unknown:
            raise ValueError(f"unsupported generation arguments {unknown} (known: {GEN_KWARGS})")
        until: Union[str, list, tuple] = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else until
        if not isinstance(until, (list, tuple)) or not all(isinstance(stop, str) for stop in until):
            raise ValueError(f"until must be a string or a list of strings, got {gen_kwargs['until']!r}")
        sample = gen_kwargs.get("do_sample", False)
        if not isinstance(sample, bool):
            raise ValueError(f"do_sample must be true or false, got {sample!r}")
        return {"until": [stop.encode("utf-8") for stop in until if stop],
                "max_new": _integer("max_gen_toks", gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS), 0),
                "temperature": gen_kwargs.get("temperature", 1.0) if sample else 0.0,
                "top_k": gen_kwargs.get("top_k"), "top_p": gen_kwargs.get("top_p")}

    @torch.no_grad()
    def _generate(self, context: list[int], until: list[bytes], max_new: int, temperature: float,
                  top_k: Optional[int], top_p: Optional[float]) -> bytes:
        for _, logits, state in self._read(context):  # read the whole context; keep the last piece's logits, state
            pass
        next_logits = logits[-1:]
        out: list[int] = []
        for _ in range(max_new):
            token = sample_next(next_logits, temperature, top_k, top_p, self.generator)
            out.append(int(token))
            text = self.codec.to_bytes(out)
            if any(stop in text for stop in until):  # a stop string is complete: nothing after it is kept
                break
            logits, state = self.model(token[:, None], state)
            next_logits = logits[:, -1]
        return cut_at_first_stop(self.codec.to_bytes(out), until)

    def generate_until(self, requests: Iterable[tuple[str, Optional[dict]]]) -> list[str]:
        """For each (context, gen_kwargs): the text generated after the context, cut at the first stop string."""
        return [self._generate(self._context(self.codec.encode(context)), **self.generation_options(gen_kwargs))
                .decode("utf-8", errors="replace") for context, gen_kwargs in requests]


class ByteLevelEvaluator(TextEvaluator):
    """A byte-level `TitansLM` (vocab 256): one token per UTF-8 byte. `prefix`: the text that stands before an empty
    context and before a rolling text (default a newline)."""

    def __init__(self, model: TitansLM, max_length: Optional[int] = None, piece_len: int = 1024, prefix: str = "\n",
                 seed: int = 0):
        if not isinstance(model, TitansLM):
            raise ValueError(f"model must be a TitansLM, got {type(model).__name__}")
        if model.config.vocab_size != BYTE_VOCAB:
            raise ValueError(f"byte-level evaluation reads bytes (vocab {BYTE_VOCAB}); this model has vocab "
                             f"{model.config.vocab_size}")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty string (an empty context needs a byte to condition on), "
                             f"got {prefix!r}")
        super().__init__(model, ByteCodec(prefix), max_length, piece_len, seed)
