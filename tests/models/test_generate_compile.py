"""`generate(decode="compiled")`: the one-token step through torch.compile gives the eager step's tokens and state.

Compiling is slow on a CPU (inductor writes and builds C++ for each graph, tens of seconds each on a loaded 2-core
machine), so one model is compiled: MAC, whose step holds every kind of state (the memory's pending chunk and its
chunk end, the segment's attention cache, the persistent tokens), at sizes that cross a memory chunk and a segment
within a few tokens. tests/models/test_models.py holds the eager step to one forward over the whole output."""

import pytest
import torch

from titans import TitansConfig, TitansLM
from titans.memory import parallel
from titans.models import lm

from .test_static_decode import flat

UNAVAILABLE = parallel.compile_unavailable("cpu")
# chunk 2 and segment 4: 9 new tokens end four chunks and two segments; depth 1 keeps the graphs small
CONFIG = dict(variant="mac", vocab_size=32, dim=16, depth=1, heads=2, segment_len=4, n_persistent=2, chunk_size=2)


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"torch.compile cannot run here: {UNAVAILABLE}")
def test_compiled_step_generates_what_the_eager_step_does():
    torch.manual_seed(0)
    model = TitansLM(TitansConfig(**CONFIG)).eval()
    with torch.no_grad():  # gates away from their init so that every memory term matters
        for name, p in model.named_parameters():
            if name.endswith("to_gates.weight"):
                p.normal_(0, 0.3)
    prompt = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    eager, eager_state = model.generate(prompt, 9, temperature=0, return_state=True)
    compiled, compiled_state = model.generate(prompt, 9, temperature=0, return_state=True, decode="compiled")
    assert torch.equal(compiled, eager)
    pairs = list(zip(flat(compiled_state), flat(eager_state), strict=True))
    assert pairs and all(a is b is None or a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
                         for a, b in pairs)
    # sampling draws the same tokens from the same generator
    draws = [model.generate(prompt, 5, top_k=8, generator=torch.Generator().manual_seed(3), decode=d)
             for d in ("dynamic", "compiled")]
    assert torch.equal(*draws)


def test_compile_where_it_cannot_run_is_an_error_that_says_why(monkeypatch):
    model = TitansLM(TitansConfig(**CONFIG)).eval()
    monkeypatch.setattr(lm, "compile_unavailable", lambda device: "no C++ compiler in this test")
    with pytest.raises(ValueError, match=r"cannot compile here: no C\+\+ compiler in this test"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, decode="compiled")
