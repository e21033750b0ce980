"""`TitansLM`: token embedding → blocks (one mixer per variant) → norm → LM head.

Every variant shares this file; what differs is the mixer, built by the function in its own file.
Models are recurrent: `forward(tokens, state)` returns the state to continue the stream, so a
sequence fed in pieces gives the same logits as one call, and generation needs no growing cache
(attention caches stop at the window or segment, memory states are constant in size).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..io.state import staged_writes
from ..layers import RMSNorm, trusted_states
from ..memory.checks import checks_values
from ..memory.parallel import COMPILED_GRAPHS, compile_unavailable
from .baselines import build_gated_deltanet_mixer, build_lstm_mixer, build_swa_mixer, build_transformer_mixer
from .common import Block, count_parameters, mlp_hidden_size
from .config import PEER_VARIANTS, TitansConfig
from .decode import DECODES, StaticDecoder
from .lmm import build_lmm_mixer
from .mac import build_mac_mixer
from .mag import build_mag_mixer
from .mal import build_mal_mixer

MIXERS: dict[str, Callable[[TitansConfig], nn.Module]] = {
    "lmm": build_lmm_mixer,
    "mac": build_mac_mixer,
    "mag": build_mag_mixer,
    "mal": build_mal_mixer,
    "transformer": build_transformer_mixer,
    "swa": build_swa_mixer,
    "lstm": build_lstm_mixer,
    "gated_deltanet": build_gated_deltanet_mixer,
}

State = list  # one entry per block: that block's mixer state (see each variant's file)


class Backbone(nn.Module):
    """The stack of blocks plus the final norm, on embeddings `[batch, seq, dim]`.

    `checkpoint_blocks` (set by the trainer's `activation_checkpointing`): in training, each block's activations are
    recomputed in the backward pass instead of kept (`torch.utils.checkpoint`, non-reentrant); the same outputs and
    gradients. The recomputation would count the memories' momentum-gain bound a second time, so it runs with their
    counters put back afterwards (`_counters_kept`)."""

    def __init__(self, cfg: TitansConfig):
        super().__init__()
        build = MIXERS[cfg.variant]
        hidden = mlp_hidden_size(cfg, build, MIXERS["mag"])
        self.blocks = nn.ModuleList(Block(build(cfg), cfg.dim, hidden, cfg.dropout) for _ in range(cfg.depth))
        self.norm = RMSNorm(cfg.dim)
        self.checkpoint_blocks = False

    def forward(self, x: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        if state is not None and len(state) != len(self.blocks):
            raise ValueError(f"state has {len(state)} entries but the model has {len(self.blocks)} blocks")
        recompute = self.checkpoint_blocks and self.training and torch.is_grad_enabled()
        new_state = []
        for i, block in enumerate(self.blocks):
            block_state = state[i] if state is not None else None
            if recompute:
                x, block_state = checkpoint(block, x, block_state, use_reentrant=False,
                                            context_fn=functools.partial(_recompute_contexts, block))
            else:
                x, block_state = block(x, block_state)
            new_state.append(block_state)
        return self.norm(x), new_state


@contextlib.contextmanager
def _counters_kept(module: nn.Module):
    """Put the momentum-gain counters of `module`'s memories back as they were (`NeuralMemory.bound_lowered`,
    `bound_gates`): what a recomputed forward counted was counted by the forward it repeats."""
    from ..memory import NeuralMemory

    memories = [m for m in module.modules() if isinstance(m, NeuralMemory)]
    saved = [(m.bound_lowered, m.bound_gates) for m in memories]
    try:
        yield
    finally:
        for m, (lowered, gates) in zip(memories, saved):
            m.bound_lowered, m.bound_gates = lowered, gates


def _recompute_contexts(block: nn.Module):
    """`checkpoint`'s context_fn: nothing around the forward, the counters kept around the recomputation."""
    return contextlib.nullcontext(), _counters_kept(block)


def check_tokens(tokens: Tensor, vocab_size: int) -> None:
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be a [batch, seq] long tensor, got {tuple(tokens.shape)} {tokens.dtype}")
    # The range is a value check: on a GPU it reads back (a host sync per call), so there only with TITANS_CHECKS=1
    # (an id out of range then fails inside the embedding instead).
    if tokens.numel() and checks_values(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"tokens must lie in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """Sampling options, checked whether or not they end up used (greedy decoding, no new tokens)."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                generator: Optional[torch.Generator] = None) -> Tensor:
    """Sample token ids `[batch]` from logits `[batch, vocab]`; temperature 0 is greedy."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are all different (json keeps the last of two silently)."""
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"duplicate key(s) {duplicates}")
    return dict(pairs)


class TitansLM(nn.Module):
    """Language model over tokens for every variant: `TitansLM(TitansConfig(variant="mac", ...))`."""

    def __init__(self, config: TitansConfig):
        super().__init__()
        if not isinstance(config, TitansConfig):
            raise ValueError(f"config must be a TitansConfig, got {type(config).__name__}")
        if config.variant in PEER_VARIANTS:
            raise ValueError(f"variant {config.variant} is another implementation's model, not a TitansLM: build it "
                             "with titans.models.peer.PeerMAC (titans.train.build_model does)")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.backbone = Backbone(config)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def num_parameters(self) -> int:
        return count_parameters(self)

    def forward(self, tokens: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        check_tokens(tokens, self.config.vocab_size)
        return self._logits(tokens, state)

    def _logits(self, tokens: Tensor, state: Optional[State]) -> tuple[Tensor, State]:
        h, state = self.backbone(self.embed(tokens), state)
        return self.head(h), state

    def loss(self, tokens: Tensor, targets: Tensor, state: Optional[State] = None) -> Tensor:
        """Mean cross-entropy over positions whose target is not -100."""
        logits, _ = self(tokens, state)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

    @torch.no_grad()
    def memorize(self, tokens: Tensor, state: Optional[State] = None) -> State:
        """Read a document once; the returned state answers later queries without the document."""
        return self(tokens, state)[1]

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, state: Optional[State] = None,
                 generator: Optional[torch.Generator] = None, return_state: bool = False,
                 decode: str = "dynamic") -> Union[Tensor, tuple[Tensor, State]]:
        """Continue `prompt` [batch, T ≥ 1] by `max_new_tokens`, one token at a time through the state.

        The state stays bounded (attention caches ≤ window or segment, memory constant; only the full-
        attention Transformer++ baseline keeps every key). Temperature 0 is greedy. Returns the prompt
        followed by the new tokens, and with `return_state` the state after the last of them.

        `decode` chooses the one-token step after the prompt, each giving the same tokens and state:
        "dynamic" (the default) steps the model's own state, whose caches change shape from token to token;
        "compiled" runs that step through torch.compile (`_compiled_logits`), the per-token Python and operator
        overhead fused away at the price of compiling on first use (tens of seconds to minutes on a CPU;
        `titans bench generate --compile` measures both); "static" steps a copy of the state in buffers of fixed
        shape, written in place (`models/decode.py`); "graph" (a model on CUDA) runs that static step as CUDA graphs,
        a whole token's step one launch instead of hundreds (the first occurrence of each chunk position runs
        eagerly, the second captures).
        """
        if prompt.dim() != 2 or prompt.shape[1] < 1:
            raise ValueError(f"prompt must be [batch, T] with T >= 1, got shape {tuple(prompt.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        check_sampling(temperature, top_k, top_p)
        if decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
        if decode == "graph" and prompt.device.type != "cuda":
            raise ValueError(f"decode='graph' captures CUDA graphs: it needs a model and prompt on a CUDA device, "
                             f"got {prompt.device} (decode='static' runs the same step without graphs)")
        step, graphs = self._logits, contextlib.nullcontext()
        if decode == "compiled":
            if (reason := compile_unavailable(prompt.device.type)) is not None:
                raise ValueError(f"generate(decode='compiled') cannot compile here: {reason}")
            step = functools.partial(_compiled_logits(), self)
            graphs = torch._dynamo.config.patch(recompile_limit=COMPILED_GRAPHS)
        logits, state = self(prompt, state)  # checks the prompt and the caller's state
        if decode in ("static", "graph"):
            decoder = StaticDecoder(self, state, max_new_tokens, graphs=decode == "graph")
            step = lambda token, _: (decoder.step(token)[:, None], None)  # noqa: E731
        tokens = [prompt]
        # From here on each token is one the sampler drew from the vocabulary and each state the one the model just
        # returned: neither is checked again (on a GPU the token check would wait for the device every step).
        with trusted_states(), graphs:
            for _ in range(max_new_tokens):
                next_token = sample_next(logits[:, -1], temperature, top_k, top_p, generator)[:, None]
                tokens.append(next_token)
                logits, state = step(next_token, state)
        if decode in ("static", "graph"):
            state = decoder.state()
        out = torch.cat(tokens, 1)
        return (out, state) if return_state else out

    def save_pretrained(self, directory: Union[str, Path], overwrite: bool = False) -> None:
        """Write `config.json` (the layout in `io/pretrained.py`, which Hugging Face's `AutoModelForCausalLM` reads
        after `import titans.io.hf`) and `model.safetensors` into `directory` (created if needed).

        A directory that already holds a saved model is refused unless `overwrite`; other files in it are left
        alone. Both files are written under temporary names first and renamed once both are complete, so a save that
        fails while writing leaves any previous model whole."""
        directory = Path(directory)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"cannot save a model to {directory}: it is a file, not a directory")
        names = ("config.json", "model.safetensors")
        if not overwrite and any((directory / name).exists() for name in names):
            raise ValueError(f"{directory} already holds a saved model; pass overwrite=True to replace it")
        directory.mkdir(parents=True, exist_ok=True)
        from ..io.pretrained import config_to_saved  # (io.pretrained imports models.config: here, not at the top)

        with staged_writes(*(directory / name for name in names)) as (config_file, weights_file):
            config_file.write_text(json.dumps(config_to_saved(self.config), indent=2))
            save_model(self, str(weights_file))

    @classmethod
    def from_pretrained(cls, directory: Union[str, Path], device: str = "cpu") -> "TitansLM":
        """Load a model that `save_pretrained`, `titans export` or `titans.io.hf` (Hugging Face) saved."""
        directory = Path(directory)
        config_path, weights_path = directory / "config.json", directory / "model.safetensors"
        for p in (config_path, weights_path):
            if not p.is_file():
                raise ValueError(f"{directory} is not a saved model: {p.name} is missing")
        try:
            data = json.loads(config_path.read_text(), object_pairs_hook=_unique_keys)
        except ValueError as err:  # malformed JSON, or a key given twice
            raise ValueError(f"{config_path} is not valid JSON: {err}") from None
        from ..io.pretrained import saved_to_config  # (as in save_pretrained)

        config = saved_to_config(data, str(config_path))
        try:
            with safe_open(str(weights_path), framework="pt") as f:  # the saved dtype, from an empty slice
                dtype = f.get_slice(next(iter(f.keys())))[:0].dtype
            model = cls(config).to(device=device, dtype=dtype)
            missing, unexpected = load_model(model, str(weights_path), strict=False, device=device)
        except (SafetensorError, OSError, RuntimeError, StopIteration) as err:
            detail = " ".join(str(err).split())[:300]
            raise ValueError(f"{weights_path} is unreadable or does not match the config: {detail}") from None
        if missing or unexpected:
            raise ValueError(f"{weights_path} does not match the config (missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]})")
        return model.eval()  # for inference, as loaded models are used; call .train() to fine-tune


@functools.lru_cache(maxsize=None)
def _compiled_logits() -> Callable[[TitansLM, Tensor, State], tuple[Tensor, State]]:
    """`TitansLM._logits` through torch.compile, for generation's one-token steps: the blocks' projections, norms,
    memory step and attention over the caches as a few fused kernels instead of hundreds of small operators per
    token. Shapes are dynamic, because a cache's length and the memory's pending tokens change from token to token;
    dynamo specialises only where the code branches on them (a chunk's end, an empty cache), so a Titans model needs
    three to five graphs. Its guards key the cache on the model and the state's structure, so one compiled callable
    serves every model (each with its own graphs, under COMPILED_GRAPHS)."""
    return torch.compile(TitansLM._logits, dynamic=True)
