"""EleutherAI lm-evaluation-harness model class: `import titans.harness` registers `--model titans`.

Byte-level, as `TitansLM` is: a string is its UTF-8 bytes, one token each (vocab 256). The model is recurrent with a
state of bounded size, so nothing is windowed: every text is read whole, in pieces of `piece_len` bytes that carry
the state (the pieces bound the activations' memory; the scores equal one call over the whole text).

- `loglikelihood`: the continuation's bytes scored after the context's bytes; `is_greedy` when each continuation
  byte is the argmax at its position. An empty context conditions on one newline byte (`prefix`), as the
  harness's BOS would: a first byte needs a position before it. A non-empty context gets no prefix.
- `loglikelihood_rolling`: the whole text after the `prefix` byte (every byte of the text is scored, once).
- `generate_until`: one byte at a time through the state, greedy by default (`temperature`, `top_k`, `top_p`
  sample when `do_sample` is true), stopping at the first `until` string (cut off) or after `max_gen_toks` bytes;
  the bytes are decoded with errors="replace".

Requests run one at a time: `batch_size` is accepted (the harness passes it) but unused, since batching texts of
different lengths would need padding and the memory would read the pads.

The harness finds no model it has not imported, so run it through this module, which registers the class first:

    python -m titans.harness --model titans --model_args pretrained=DIR --tasks ...

or from Python: `import titans.harness`, then `lm_eval.simple_evaluate(model="titans", model_args=...)`.
`import titans` does not import lm_eval; only this module does (`pip install "titans[eval]"`).
"""

from __future__ import annotations

from typing import Any, Optional

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as err:
    raise ImportError('titans.harness needs EleutherAI lm-evaluation-harness (lm_eval >= 0.4.13): '
                      'pip install "titans[eval]"') from err

import torch
import torch.nn.functional as F

from .models.lm import State, TitansLM, sample_next

__all__ = ["TitansHarnessLM"]

BYTE_VOCAB = 256
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def _encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@register_model("titans")
class TitansHarnessLM(LM):
    """A saved byte-level `TitansLM` (`save_pretrained` or `titans export` output) as an lm-eval model.

    `pretrained`: the model directory. `device`: where it runs (default: cuda if available, else cpu). `dtype`:
    cast the weights (e.g. "float32"; default: as saved). `max_length`: keep only the last `max_length` bytes of
    each context (default: all of it; the state carries any length). `piece_len`: bytes read per forward call.
    `prefix`: the text that stands before an empty context and before a rolling text (default a newline).
    """

    def __init__(self, pretrained: str, device: Optional[str] = None, dtype: Optional[str] = None,
                 batch_size: Any = 1, max_batch_size: Any = None, max_length: Optional[int] = None,
                 piece_len: int = 1024, prefix: str = "\n", seed: int = 0, **unused: Any):
        super().__init__()
        if unused:
            raise ValueError(f"titans model: unknown model_args {sorted(unused)}")
        if max_length is not None and int(max_length) < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if int(piece_len) < 1:
            raise ValueError(f"piece_len must be >= 1, got {piece_len}")
        if not prefix:
            raise ValueError("prefix must be a non-empty string (an empty context needs a byte to condition on)")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._device = torch.device(device)
        model = TitansLM.from_pretrained(str(pretrained), device=str(self._device))
        if model.config.vocab_size != BYTE_VOCAB:
            raise ValueError(f"{pretrained}: the harness reads bytes (vocab 256); this model has vocab "
                             f"{model.config.vocab_size}")
        if dtype is not None:
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise ValueError(f"dtype must name a torch dtype (e.g. float32), got {dtype!r}")
            model = model.to(getattr(torch, str(dtype)))
        self.model = model.eval()
        self.batch_size = batch_size
        self.max_length = None if max_length is None else int(max_length)
        self.piece_len = int(piece_len)
        self.prefix = _encode(prefix)
        self.generator = torch.Generator(device=self._device).manual_seed(int(seed))

    # -- scoring ------------------------------------------------------------------------------------------------

    def _context(self, context: str) -> list[int]:
        tokens = _encode(context)
        if self.max_length is not None:
            tokens = tokens[-self.max_length:]
        return tokens or list(self.prefix)

    @torch.no_grad()
    def _score(self, tokens: list[int], n_scored: int) -> tuple[float, bool]:
        """Sum of log-probs (float64) of the last `n_scored` tokens given those before, and whether each is the
        argmax at its position. The inputs are read in pieces of `piece_len`, carrying the state."""
        if n_scored == 0:
            return 0.0, True
        if n_scored >= len(tokens):
            raise ValueError("every scored token needs a token before it")
        seq = torch.tensor(tokens, dtype=torch.long, device=self._device)
        inputs, targets = seq[:-1], seq[1:]
        first = len(inputs) - n_scored  # input positions from here on predict a scored token
        total, greedy, state = 0.0, True, None
        for start in range(0, len(inputs), self.piece_len):
            stop = min(start + self.piece_len, len(inputs))
            logits, state = self.model(inputs[None, start:stop], state)
            lo = max(first, start)
            if lo >= stop:
                continue
            logits = logits[0, lo - start:]
            target = targets[lo:stop]
            logp = F.log_softmax(logits.double(), dim=-1)
            total += logp.gather(-1, target[:, None]).sum().item()
            greedy = greedy and bool((logits.argmax(-1) == target).all())
        return total, greedy

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            context, continuation = request.args
            ctx, cont = self._context(context), _encode(continuation)
            result = self._score(ctx + cont, len(cont))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), result)
            out.append(result)
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args
            body = _encode(text)
            logprob, _ = self._score(self.prefix + body, len(body))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), logprob)
            out.append(logprob)
        return out

    # -- generation ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _generate(self, context: list[int], until: list[bytes], max_new: int, temperature: float,
                  top_k: Optional[int], top_p: Optional[float]) -> bytes:
        state: Optional[State] = None
        seq = torch.tensor(context, dtype=torch.long, device=self._device)
        for start in range(0, len(context), self.piece_len):
            logits, state = self.model(seq[None, start:start + self.piece_len], state)
        out = bytearray()
        for _ in range(max_new):
            token = sample_next(logits[:, -1], temperature, top_k, top_p, self.generator)
            out.append(int(token))
            for stop in until:  # only a match that ends at the new byte is new
                at = out.find(stop, max(0, len(out) - len(stop)))
                if at >= 0:
                    return self._cut(bytes(out), until)
            logits, state = self.model(token[:, None], state)
        return self._cut(bytes(out), until)

    @staticmethod
    def _cut(out: bytes, until: list[bytes]) -> bytes:
        hits = [at for at in (out.find(stop) for stop in until) if at >= 0]
        return out[:min(hits)] if hits else out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            context, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs or {})
            unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
            if unknown:
                raise ValueError(f"titans model: unsupported generation arguments {unknown} (known: {GEN_KWARGS})")
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            until_bytes = [s.encode("utf-8") for s in until if s]
            max_new = int(gen_kwargs.get("max_gen_toks", 256))
            sample = bool(gen_kwargs.get("do_sample", False))
            temperature = float(gen_kwargs.get("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            text = self._generate(self._context(context), until_bytes, max_new, temperature,
                                  gen_kwargs.get("top_k"), gen_kwargs.get("top_p")).decode("utf-8", errors="replace")
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


if __name__ == "__main__":  # python -m titans.harness <lm_eval arguments>: the harness's CLI, `titans` registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
