"""EleutherAI lm-evaluation-harness model class: `import titans.harness` registers `--model titans`.

A thin layer over `titans.models.text_eval.TextEvaluator`, which holds the logic and documents it (scoring through the
model's tokenizer, or byte-level for a model saved without one; what stands before an empty context, piecewise reading
that carries the state, greedy or sampled generation cut at the first `until` string): this class unpacks the harness's
requests, calls the evaluator and feeds the harness's cache. `batch_size` is accepted (the harness passes it) but
unused: requests run one at a time.

The harness finds no model it has not imported, so run it through this module, which registers the class first:

    python -m titans.harness --model titans --model_args pretrained=DIR --tasks ...

or from Python: `import titans.harness`, then `lm_eval.simple_evaluate(model="titans", model_args=...)`.
`import titans` does not import lm_eval; only this module does (`pip install "titans[eval]"`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as err:
    raise ImportError('titans.harness needs EleutherAI lm-evaluation-harness (lm_eval >= 0.4.13): '
                      'pip install "titans[eval]"') from err

from ..models.text_eval import TextEvaluator

__all__ = ["TitansHarnessLM"]


@register_model("titans")
class TitansHarnessLM(LM):
    """A saved `TitansLM` (`save_pretrained` or `titans export` output) as an lm-eval model: through the tokenizer
    saved beside it, or byte-level where there is none.

    `pretrained`: the model directory. `device`: where it runs (default: cuda if available, else cpu). `dtype`:
    cast the weights (e.g. "float32"; default: as saved). `max_length`: keep only the last `max_length` tokens of
    each context (default: all of it; the state carries any length). `piece_len`: tokens read per forward call.
    `prefix` (byte-level models only): the text that stands before an empty context and before a rolling text
    (default a newline; a tokenizer's model puts its end-of-text token there). `seed`: the sampling generator's seed.
    """

    def __init__(self, pretrained: str, device: Optional[str] = None, dtype: Optional[str] = None,
                 batch_size: Any = 1, max_batch_size: Any = None, max_length: Optional[int] = None,
                 piece_len: int = 1024, prefix: Optional[str] = None, seed: int = 0, **unused: Any):
        super().__init__()
        if unused:
            raise ValueError(f"titans model: unknown model_args {sorted(unused)}")
        self.batch_size = batch_size
        options = {} if prefix is None else {"prefix": prefix}
        self.evaluator = TextEvaluator.from_pretrained(pretrained, device=device, dtype=dtype, max_length=max_length,
                                                       piece_len=piece_len, seed=seed, **options)

    def _answer(self, request_type: str, requests: list, evaluate: Callable[[list], list]) -> list:
        """Each request's arguments through `evaluate`, every result added to the harness's cache under them."""
        arguments = [request.args for request in requests]
        results = evaluate(arguments)
        for args, result in zip(arguments, results):
            self.cache_hook.add_partial(request_type, args, result)
        return results

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._answer("loglikelihood", requests, self.evaluator.loglikelihood)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        return self._answer("loglikelihood_rolling", requests,
                            lambda arguments: self.evaluator.loglikelihood_rolling(text for (text,) in arguments))

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        return self._answer("generate_until", requests, self.evaluator.generate_until)


def main() -> None:
    """lm-eval's command line with `--model titans` registered (`python -m titans.harness <lm_eval arguments>`)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
