"""titans-pytorch's MemoryAsContextTransformer (the `compare` extra), behind our model interface: a row beside ours.

A reader of our results cannot otherwise tell a result of Titans from a result of our implementation of it; the
implementation users would otherwise pick trains and is evaluated here exactly as our variants are (the same tasks,
budget, steps, seeds and evaluation sequences). `TitansConfig(variant="titans_pytorch_mac")` builds it from the
fields both models have (vocabulary, width, depth, heads, segment length, persistent tokens, the memory MLP's depth
and expansion), with its README's long-term memory tokens (16), everything else at the package's defaults, and
`titans_pytorch` (keyword options of its constructor) laid over that. Its own defaults differ from ours in ways that
are its design, not our config: four residual streams (hyper-connections), its memory chunk the whole attention
window (segment + long-term tokens), memory written from and read by the block's input stream, the read added to the
residual stream (DESIGN.md §3; §1's MAC open item).

What it cannot do: continue a stream. Its forward reads a whole sequence and returns no state our loop can carry (its
own cache serves its sampler, one token at a time), so evaluation through the state in pieces (`eval_piece`) and
training across carried windows (`carry_windows`) are refused when the model is built, and a state passed to its
forward is refused there. Nor does it save through `save_pretrained` (it is not a TitansLM).
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any, Optional

from torch import Tensor, nn

from .config import TitansConfig

PACKAGE, CLASS = "titans-pytorch", "MemoryAsContextTransformer"
INSTALL = "pip install -c constraints.txt '.[compare]'"
# its README's example (MemoryAsContextTransformer(num_tokens=256, dim=256, depth=2, segment_len=128,
# num_persist_mem_tokens=4, num_longterm_mem_tokens=16)) beside what our config gives it
RECOMMENDED: dict[str, Any] = {"num_longterm_mem_tokens": 16}
# the constructor's options our config's own fields give (`peer_options`): set them there, not in `titans_pytorch`
DERIVED = ("num_tokens", "dim", "depth", "heads", "dim_head", "segment_len", "num_persist_mem_tokens")


def peer_options(cfg: TitansConfig) -> dict[str, Any]:
    """The keyword options of MemoryAsContextTransformer for `cfg`: ours where both models have the field, its
    README's long-term memory tokens, the memory an MLP of `cfg.memory.depth` layers (its default model, MemoryMLP,
    with our expansion), then `cfg.titans_pytorch` over everything."""
    given = sorted(set(cfg.titans_pytorch) & set(DERIVED))
    if given:
        raise ValueError(f"titans_pytorch: {given} come from the config's own fields (vocab_size, dim, depth, heads, "
                         "segment_len, n_persistent); set them there")
    memory = {"default_model_kwargs": {"depth": cfg.memory.depth, "expansion_factor": float(cfg.memory.expansion)}}
    return {"num_tokens": cfg.vocab_size, "dim": cfg.dim, "depth": cfg.depth, "heads": cfg.heads,
            "dim_head": cfg.dim // cfg.heads, "segment_len": cfg.attention.segment_len,
            "num_persist_mem_tokens": cfg.attention.n_persistent, "neural_memory_kwargs": memory, **RECOMMENDED,
            **cfg.titans_pytorch}


def installed_version() -> Optional[str]:
    """titans-pytorch's installed version; None where it is not installed."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_streaming(eval_piece: Optional[int], carry_windows: int) -> None:
    """The peer reads whole sequences only: a run that streams through the state is refused, naming why."""
    if eval_piece is not None or carry_windows > 1:
        raise ValueError(f"{PACKAGE}'s {CLASS} cannot continue a stream (its forward returns no state to carry), so "
                         f"it cannot evaluate through the state in pieces (eval_piece={eval_piece}) or train across "
                         f"carried windows (carry_windows={carry_windows}); set eval_piece: null and carry_windows: 1 "
                         "for its runs")


class PeerMAC(nn.Module):
    """MemoryAsContextTransformer with our forward: `forward(tokens [B, T]) -> (logits [B, T, vocab], None)`."""

    def __init__(self, config: TitansConfig):
        super().__init__()
        try:
            from titans_pytorch import MemoryAsContextTransformer
        except ImportError:
            raise ValueError(f"variant {config.variant} is {PACKAGE}'s {CLASS}, which is not installed: "
                             f"{INSTALL}") from None
        self.config = config
        self.options = peer_options(config)
        accepted = set(inspect.signature(MemoryAsContextTransformer.__init__).parameters) - {"self"}
        unknown = sorted(set(self.options) - accepted)
        if unknown:
            raise ValueError(f"titans_pytorch: {CLASS} {installed_version()} takes no option(s) {unknown}")
        self.model = MemoryAsContextTransformer(**self.options)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: Tensor, state: Any = None) -> tuple[Tensor, None]:
        from .lm import check_tokens

        if state is not None:
            check_streaming(eval_piece=1, carry_windows=1)  # the same refusal, naming why
        check_tokens(tokens, self.config.vocab_size)
        return self.model(tokens), None

    def record(self) -> dict[str, Any]:
        """What a run's results record of the implementation: the package, its version, the class and its options."""
        return {"package": PACKAGE, "version": installed_version(), "class": CLASS, "options": self.options}


def implementation_record(model: nn.Module) -> dict[str, Any]:
    """{"implementation": the peer's record} for a peer model, {} for ours: what a run's eval.json adds."""
    return {"implementation": model.record()} if isinstance(model, PeerMAC) else {}
