"""titans-pytorch's MemoryAsContextTransformer as a row beside ours (models/peer.py): built from our config, trained
and evaluated by our loop and the experiment runner, its parameter count and package version in the run's JSON, and
refused clearly where a run would stream through a state it does not have."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from titans.experiments import load_experiment, run_experiment
from titans.models import TitansConfig, TitansLM
from titans.models.config import MAC_SWITCHES, unread_fields
from titans.models.peer import PeerMAC, peer_options
from titans.train import build_model, build_task
from titans.train.config import load_train_config

FOLDER = Path(__file__).resolve().parents[2] / "configs" / "experiments"
PEER = "titans_pytorch_mac"
TINY = dict(variant=PEER, vocab_size=32, dim=16, depth=2, heads=2, segment_len=8, n_persistent=2)
needs_peer = pytest.mark.skipif(
    importlib.util.find_spec("titans_pytorch") is None,
    reason="titans-pytorch is not installed (the `compare` extra, which CI's `make test` does not install)")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_options_come_from_our_config_and_its_readme():
    cfg = TitansConfig(**TINY, memory={"depth": 2}, titans_pytorch={"num_residual_streams": 1})
    options = peer_options(cfg)
    assert options["dim"] == 16 and options["heads"] == 2 and options["dim_head"] == 8 and options["segment_len"] == 8
    assert options["num_persist_mem_tokens"] == 2 and options["num_longterm_mem_tokens"] == 16
    assert options["neural_memory_kwargs"] == {"default_model_kwargs": {"depth": 2, "expansion_factor": 4.0}}
    assert options["num_residual_streams"] == 1
    with pytest.raises(ValueError, match="come from the config's own fields"):
        peer_options(TitansConfig(**TINY, titans_pytorch={"dim": 8}))
    with pytest.raises(ValueError, match="another implementation's model, not a TitansLM"):
        TitansLM(TitansConfig(**TINY))


def test_without_the_package_it_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "titans_pytorch", None)  # an import of it fails
    with pytest.raises(ValueError, match=r"not installed: pip install -c constraints.txt '.\[compare\]'"):
        PeerMAC(TitansConfig(**TINY))


def passkey_config(**changes):
    return load_train_config(data={
        "model": {k: v for k, v in TINY.items() if k != "vocab_size"},
        "task": {"name": "niah_passkey", "options": {"digits": 2}, "train_length": 128, "eval_lengths": [128, 256]},
        "steps": 2, "batch_size": 2, "eval_batches": 1, "eval_batch_size": 2, **changes})


@needs_peer
def test_it_is_causal_and_refuses_a_stream():
    cfg = passkey_config()
    model = build_model(cfg, build_task(cfg)).eval()
    x = torch.randint(0, cfg.model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    logits, state = model(x)
    assert logits.shape == (2, 20, cfg.model.vocab_size) and state is None
    changed = x.clone()
    changed[:, 11] = (changed[:, 11] + 1) % cfg.model.vocab_size
    assert torch.allclose(model(changed)[0][:, :11], logits[:, :11], atol=1e-5)  # the future does not leak back
    with pytest.raises(ValueError, match="cannot continue a stream"):
        model(x, state=[])
    for streaming in ({"eval_piece": 16}, {"carry_windows": 2}):
        cfg = passkey_config(**streaming)
        with pytest.raises(ValueError, match="cannot continue a stream"):
            build_model(cfg, build_task(cfg))


@needs_peer
def test_a_field_it_does_not_read_changes_nothing():
    """`unread_fields` for the peer (our MAC's switches, MAL's residual), which lets the runner read its runs back
    across a change of our defaults, is true: flipping such a field builds the same weights and the same outputs."""
    x = torch.randint(0, 32, (2, 20), generator=torch.Generator().manual_seed(0))
    base = TitansConfig(**TINY)
    fields = unread_fields(base)
    assert MAC_SWITCHES <= fields and "mal_residual" in fields
    same = PeerMAC(base).eval()
    for field in fields:
        flipped = PeerMAC(base.replace(**{field: not getattr(base, field)})).eval()
        # its hyper-connections draw part of their init outside torch's seed: the same weights are loaded into both
        flipped.load_state_dict(same.state_dict())  # strict: the same names and shapes
        assert torch.equal(flipped(x)[0], same(x)[0])


@needs_peer
def test_it_trains_in_the_runner_and_its_json_records_parameters_and_version(tmp_path):
    """niah's quick tier with the peer's row alone: trained a few steps and evaluated at 1x and 2x like any row, its
    record holding its parameter count and the package, version, class and options it was built with."""
    exp = load_experiment("niah", quick=True, folder=FOLDER).replace(variants=[PEER], extra_models={})
    data = json.loads(run_experiment(exp, tmp_path, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    (record,) = data["runs"].values()
    assert "error" not in record and record["model"] == PEER and record["steps"] == exp.base["steps"]
    cfg = load_train_config(data=record["config"])
    model = build_model(cfg, build_task(cfg))
    assert record["num_parameters"] == model.num_parameters() > 0
    implementation = record["implementation"]
    assert implementation["package"] == "titans-pytorch" and implementation["version"] == "0.5.5"
    assert implementation["class"] == "MemoryAsContextTransformer" and implementation["options"]["dim"] == 16
    assert all(v is not None for v in data["results"][PEER].values()) and data["second"]["results"][PEER]
