"""On a GPU (marked `cuda`; skipped with a reason where torch.cuda.is_available() is False, tests/conftest.py):
every variant trains under bf16 autocast, a tiny model's forward matches the CPU's, streaming in pieces equals one
call, a training step reads nothing back from the device, and decoding through CUDA graphs equals eager decoding."""

import math
from pathlib import Path

import pytest
import torch

from titans import TitansConfig, TitansLM
from titans.models import VARIANTS, StaticDecoder
from titans.train import Trainer, load_train_config, train

from .models.test_static_decode import assert_same_state

pytestmark = pytest.mark.cuda

TINY_RUN = Path(__file__).parent / "train" / "tiny.yaml"
# window 5, MAC segment 6, memory chunk 4: ~20 tokens cross every boundary several times (as tests/models)
TINY_MODEL = dict(vocab_size=32, dim=16, depth=2, heads=2, window=5, segment_len=6, n_persistent=2, chunk_size=4)
CUDA = torch.device("cuda")


@pytest.fixture
def exact_float32(monkeypatch):
    """float32 matmuls and convolutions in float32 (no TF32 rounding of their inputs to 10 bits)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def tiny_model(variant: str) -> TitansLM:
    """float64 on the CPU, gates away from their init so that every memory term matters."""
    torch.manual_seed(0)
    model = TitansLM(TitansConfig(variant=variant, **TINY_MODEL)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("to_gates.weight"):
                p.normal_(0, 0.3)
    return model.eval()


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY_MODEL["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_trains_under_bf16_autocast(variant, tmp_path):
    overrides = [f"model.variant={variant}", "model.segment_len=8", "model.window=8", "device=cuda",
                 "dtype=bfloat16", "steps=4", "checkpoint_every=0"]
    result = train(load_train_config(TINY_RUN, overrides), tmp_path / "run", quiet=True)
    assert math.isfinite(result.final_loss) and result.skipped_steps == 0
    assert all(math.isfinite(m["loss"]) for m in result.evaluation.values())
    trainer = Trainer(load_train_config(TINY_RUN, overrides), tmp_path / "again", quiet=True)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert trainer.defer_reads and trainer.optimizer.defaults["fused"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_cuda_forward_matches_the_cpu_float64_forward(variant, exact_float32):
    """float64 on the GPU equals the CPU's to rounding. float32 on the GPU is held to the CPU's float64 as closely
    as the CPU's own float32 is, within a factor 2: the models' RMSNorm takes eps = finfo(dtype).eps, so float32
    and float64 differ by more than rounding where activations are small (at init: 3e-4 relative; MAL's norm of
    the memory's small output, 1e-1)."""
    model = tiny_model(variant)
    x = tokens(2, 20)
    reference = model(x)[0]
    assert (model.to(CUDA)(x.to(CUDA))[0].cpu() - reference).abs().max() <= 1e-10
    cpu32 = model.cpu().float()(x)[0].double()
    cuda32 = model.to(CUDA)(x.to(CUDA))[0].double().cpu()
    cpu_gap = (cpu32 - reference).abs().max().item()
    assert (cuda32 - reference).abs().max().item() <= 2 * cpu_gap + 1e-5
    assert (cuda32 - cpu32).abs().max().item() <= 1e-4  # the same float32 function on either device


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cuts", [[1, 4, 7, 13, 18], [3, 9, 10, 11, 17]])
def test_pieces_with_state_equal_one_call_on_cuda(variant, cuts, exact_float32):
    """tests/models' streaming equivalence on the GPU: in float64 to the same 1e-10, in float32 to its rounding."""
    x = tokens(2, 20, seed=1).to(CUDA)
    bounds = [0, *cuts, 20]
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        model = tiny_model(variant).to(CUDA, dtype)
        logits, _ = model(x)
        state, pieces = None, []
        for a, b in zip(bounds, bounds[1:]):
            piece, state = model(x[:, a:b], state)
            pieces.append(piece)
        assert (torch.cat(pieces, 1) - logits).abs().max().item() <= tolerance, dtype


@pytest.mark.parametrize("variant", ["transformer", "lmm", "mac"])
def test_a_training_step_reads_nothing_back_from_the_gpu(variant, tmp_path):
    """CUDA's sync debug mode turns any host sync into an error: a bf16 training step launches its work and returns
    without waiting; the numbers come back at the read. The memory variants on the Triton kernels, the default on
    CUDA (the fused chunk loop, where triton is absent, reads its state bound back once per chunk: memory/fused.py
    `_bound_state`)."""
    if variant != "transformer":
        pytest.importorskip("triton", reason="the memory's sync-free path on CUDA is the Triton kernels")
    cfg = load_train_config(TINY_RUN, [f"model.variant={variant}", "model.segment_len=8", "device=cuda",
                                       "dtype=bfloat16", "steps=4", "log_every=100", "checkpoint_every=0"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    trainer.train_step()  # the first step builds the optimiser's state
    trainer.step += 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            trainer.train_step()
            trainer.step += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    read = trainer.read_steps()
    assert [r.step for r in read] == [1, 2, 3] and all(r.applied for r in read)


def test_the_token_range_is_read_back_only_in_debug_mode(monkeypatch):
    """On the GPU the token range check is a host read: it runs with TITANS_CHECKS=1 (as the memory's value checks
    do), and then refuses an id out of range with the CPU's message."""
    model = tiny_model("transformer").to(CUDA)
    bad = torch.tensor([[1, 99]], device=CUDA)
    monkeypatch.setenv("TITANS_CHECKS", "1")
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 32\)"):
        model(bad)
    monkeypatch.delenv("TITANS_CHECKS")
    ids = tokens(1, 8).to(CUDA)  # (a copy from pageable host memory is itself a sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(ids)  # in range, without the debug mode: no sync
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_decoding_generates_what_eager_cuda_decoding_does(variant):
    """generate(decode="graph"): the static step captured in CUDA graphs and replayed gives eager CUDA generation's
    tokens and state, float64 to 1e-10 (tests/models/test_static_decode.py holds the static step to the dynamic one on
    the CPU). 22 new tokens: every phase (chunk position, MAC's segment end) comes at least twice, so most tokens
    replay a captured graph, across chunk ends, segment ends and the window's wrap."""
    model = tiny_model(variant).to(CUDA)
    for length in (3, 11):
        prompt = tokens(2, length, seed=length).to(CUDA)
        eager, eager_state = model.generate(prompt, 22, temperature=0, return_state=True)
        graph, graph_state = model.generate(prompt, 22, temperature=0, return_state=True, decode="graph")
        assert torch.equal(graph, eager), f"prompt of {length}"
        assert_same_state(graph_state, eager_state)
    draws = [model.generate(prompt, 16, top_p=0.9, generator=torch.Generator(CUDA).manual_seed(3), decode=decode)
             for decode in ("dynamic", "graph")]
    assert torch.equal(*draws)


@pytest.mark.parametrize("variant", ["transformer", "lmm", "mac", "mag", "gated_deltanet"])
def test_replayed_decoding_reads_nothing_back_from_the_gpu(variant):
    """Once every phase is captured, a greedy decode step (replay, argmax, the token into the graph's input) launches
    its work without waiting for the device: CUDA's sync debug mode turns any host sync into an error."""
    model = tiny_model(variant).to(CUDA)
    decoder = StaticDecoder(model, model(tokens(2, 7).to(CUDA))[1], 40, graphs=True)
    token = tokens(2, 1).to(CUDA)
    for _ in range(24):  # MAC's phases repeat every lcm(chunk 4, segment 6) = 12 tokens
        token = decoder.step(token).argmax(-1, keepdim=True)
    assert decoder.captured >= 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):
            token = decoder.step(token).argmax(-1, keepdim=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_graph_decoding_refuses_a_model_in_training_mode():
    model = tiny_model("lmm").to(CUDA).train()
    with pytest.raises(ValueError, match=r"call model.eval\(\) first"):
        model.generate(tokens(1, 3).to(CUDA), 2, decode="graph")
