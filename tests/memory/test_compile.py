"""implementation="compile": the autograd path's chunk step through torch.compile, held in float64 to 1e-10 against
the autograd path and the token-by-token reference, values and the gradients of every input.

Compiling is slow on a CPU (inductor writes and builds C++, tens of seconds per graph on a loaded 2-core machine), so
the cases below share as few graphs as they can: one per memory depth, the ragged last chunk running uncompiled."""

import functools

import pytest
import torch

from titans.memory import Gates, parallel, parallel_memory, sequential_memory

from .test_functional import flat, gated, make_inputs, max_diff, paper

UNAVAILABLE = parallel.compile_unavailable("cpu")
needs_inductor = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"torch.compile cannot run here: {UNAVAILABLE}")

EVERY_SWITCH = paper(max_grad_norm=2.0, max_state_norm=0.6, normalize_chunk=True, hidden_step=0.3)


@needs_inductor
@pytest.mark.parametrize(
    "depth, rule, checkpoint_chunks",
    [(1, paper(), None), (2, EVERY_SWITCH, None), (2, EVERY_SWITCH, 2)],
    ids=["depth 1, the paper's rule", "depth 2, bounds, normalised chunk, ρ", "the same in recomputation groups"],
)
def test_compiled_chunk_step_matches_autograd_and_the_reference(monkeypatch, depth, rule, checkpoint_chunks):
    """Seq 13 in chunks of 4: three compiled chunks and a ragged one of 1 that runs uncompiled (with recomputation
    groups of 2 chunks, the first group is recomputed in the backward pass, the second chunk group is not)."""
    args = make_inputs(seq=13, depth=depth, requires_grad=True)
    compiled = parallel._compiled_chunk_step()  # built before the spy below, so it compiles the real step
    eager_chunks, eager_step = [], parallel._chunk_step

    def counted_step(*step_args):
        eager_chunks.append(step_args[1].shape[2])
        return eager_step(*step_args)

    outs = {}
    for name, fn in (("compile", functools.partial(parallel_memory, implementation="compile",
                                                   checkpoint_chunks=checkpoint_chunks)),
                     ("autograd", functools.partial(parallel_memory, implementation="autograd")),
                     ("reference", sequential_memory)):
        with monkeypatch.context() as patch:
            patch.setattr(parallel, "_chunk_step", counted_step)
            y, W, S = fn(*gated(args), rule=rule, chunk_size=4)
        loss = (y**2).sum() + sum((w**3).sum() for w in W) + sum(s.sum() for s in S)
        outs[name] = [y, *W, *S, *torch.autograd.grad(loss, flat(args))]
        if name == "compile":  # only the ragged chunk went through the uncompiled step
            assert eager_chunks == [1] and parallel._compiled_chunk_step() is compiled
    assert eager_chunks == [1, 4, 4, 4, 1]  # then the autograd path's four chunks; the reference has its own loop
    assert max_diff(outs["compile"], outs["autograd"]) <= 1e-10
    assert max_diff(outs["compile"], outs["reference"]) <= 1e-10


def test_compile_is_served_only_when_asked_for_and_where_it_can_run(monkeypatch):
    """The default never picks "compile"; a callable θ and a channel-wise α take the autograd path as for every
    implementation; where inductor cannot run, asking for "compile" is an error that says why."""
    q, k, v, theta, eta, alpha, weights, momentum = make_inputs(seq=8, depth=2)
    channels = tuple(alpha.unsqueeze(-1).expand(*alpha.shape, w.shape[-1]) for w in weights)
    assert parallel.serving_implementation(None, q, theta, alpha, weights) == "fused"
    assert parallel.serving_implementation("compile", q, lambda *a: theta, alpha, weights) == "autograd"
    assert parallel.serving_implementation("compile", q, theta, channels, weights) == "autograd"
    if UNAVAILABLE is None:
        assert parallel.serving_implementation("compile", q, theta, alpha, weights) == "compile"
    monkeypatch.setattr(parallel, "compile_unavailable", lambda device: "no C++ compiler in this test")
    with pytest.raises(ValueError, match="implementation='compile' cannot serve this call: no C.. compiler"):
        parallel_memory(q, k, v, Gates(theta, eta, alpha), weights, momentum, rule=paper(), implementation="compile")
