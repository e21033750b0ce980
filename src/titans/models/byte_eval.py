"""Byte-level scoring and generation over a `TitansLM`: the logic behind lm-evaluation-harness's three request types.

`titans.harness` is the thin lm-eval layer over `ByteLevelEvaluator` (it unpacks requests and feeds the harness's
cache); this module does not import lm_eval, so it is tested without the `eval` extra.

Byte-level, as `TitansLM` is: a string is its UTF-8 bytes, one token each (vocab 256). The model is recurrent with a
state of bounded size, so nothing is windowed: every text is read whole, in pieces of `piece_len` bytes that carry
the state (the pieces bound the activations' memory; the scores equal one call over the whole text).

- `loglikelihood`: the continuation's bytes scored after the context's bytes; `is_greedy` when each continuation
  byte is the argmax at its position. An empty context conditions on `prefix` (one newline byte by default), as the
  harness's BOS would: a first byte needs a position before it. A non-empty context gets no prefix.
- `loglikelihood_rolling`: the whole text after the `prefix` bytes (every byte of the text is scored, once).
- `generate_until`: one byte at a time through the state, greedy by default (`temperature`, `top_k`, `top_p`
  sample when `do_sample` is true), stopping at the first `until` string (cut off) or after `max_gen_toks` bytes;
  the bytes are decoded with errors="replace".

`max_length` keeps only the last `max_length` bytes of each context (default: all of it; the state carries any
length). Requests run one at a time: batching texts of different lengths would need padding, and the memory would
read the pads.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .lm import State, TitansLM, sample_next

__all__ = ["BYTE_VOCAB", "GEN_KWARGS", "ByteLevelEvaluator", "cut_at_first_stop", "encode_bytes"]

BYTE_VOCAB = 256
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
DEFAULT_MAX_GEN_TOKS = 256


def encode_bytes(text: str) -> list[int]:
    """The UTF-8 bytes of `text`, one token each."""
    return list(text.encode("utf-8"))


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


class ByteLevelEvaluator:
    """A byte-level `TitansLM` (vocab 256) answering loglikelihood, rolling loglikelihood and generate_until.

    `max_length`: keep only the last `max_length` bytes of each context (None: all). `piece_len`: bytes read per
    forward call. `prefix`: the text that stands before an empty context and before a rolling text. `seed`: the
    sampling generator's seed (used only when a request samples).
    """

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
        self.model = model.eval()
        self.device = model.embed.weight.device
        self.max_length = None if max_length is None else _integer("max_length", max_length, 1)
        self.piece_len = _integer("piece_len", piece_len, 1)
        self.prefix = encode_bytes(prefix)
        self.generator = torch.Generator(device=self.device).manual_seed(_integer("seed", seed, 0))

    @classmethod
    def from_pretrained(cls, pretrained: str, device: Optional[str] = None, dtype: Optional[str] = None,
                        **options: Any) -> "ByteLevelEvaluator":
        """Load a saved model (`save_pretrained` or `titans export` output) onto `device` (default: cuda if
        available, else cpu), cast to the floating dtype named by `dtype` (e.g. "float32"; default: as saved).
        `options` are the constructor's (`max_length`, `piece_len`, `prefix`, `seed`)."""
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
        return cls(model if cast is None else model.to(cast), **options)

    # -- reading ------------------------------------------------------------------------------------------------

    def _context(self, context: str) -> list[int]:
        """The context's bytes, the last `max_length` of them; the prefix when there are none."""
        tokens = encode_bytes(context)
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
            continuation_bytes = encode_bytes(continuation)
            out.append(self._score(self._context(context) + continuation_bytes, len(continuation_bytes)))
        return out

    def loglikelihood_rolling(self, texts: Iterable[str]) -> list[float]:
        """For each text: the log-prob of all its bytes after the prefix."""
        out = []
        for text in texts:
            body = encode_bytes(text)
            out.append(self._score(self.prefix + body, len(body))[0])
        return out

    # -- generation ---------------------------------------------------------------------------------------------

    @staticmethod
    def generation_options(gen_kwargs: Optional[dict]) -> dict[str, Any]:
        """lm-eval's generation arguments, checked: the stop strings as bytes, the byte budget and the sampler's
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
        out = bytearray()
        for _ in range(max_new):
            token = sample_next(next_logits, temperature, top_k, top_p, self.generator)
            out.append(int(token))
            if any(out.endswith(stop) for stop in until):  # only a match that ends at the new byte is new
                break
            logits, state = self.model(token[:, None], state)
            next_logits = logits[:, -1]
        return cut_at_first_stop(bytes(out), until)

    def generate_until(self, requests: Iterable[tuple[str, Optional[dict]]]) -> list[str]:
        """For each (context, gen_kwargs): the text generated after the context, cut at the first stop string."""
        return [self._generate(self._context(context), **self.generation_options(gen_kwargs))
                .decode("utf-8", errors="replace") for context, gen_kwargs in requests]
