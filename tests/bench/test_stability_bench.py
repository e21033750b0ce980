"""`titans bench stability` at toy sizes: every case runs, the summaries count them, the JSON holds every result."""

import json
import math

import torch
from typer.testing import CliRunner

from titans.bench.stability import StreamCase, TrainCase, describe_streams, run_stream, run_training, summarize
from titans.cli import app
from titans.memory import NeuralMemory


def test_bench_stability_end_to_end(tmp_path):
    out = tmp_path / "stability.json"
    args = ["bench", "stability", "--tokens", "48", "--train-tokens", "16", "--depths", "1,2", "--activations", "gelu",
            "--momentum", "on", "--chunk-sizes", "4", "--scales", "1,1000", "--dtypes", "float32", "--train-steps", "2",
            "--lrs", "0.01", "--workers", "1", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(data["streams"]) == 2 * 2 * 2 * 2  # rules × depths × scales × gates
    assert len(data["training"]) == 2 * 2 * 2  # rules × depths × scales
    assert data["summaries"]["streams"]["ours"]["all"] == "8/8"
    assert data["summaries"]["training"]["ours"]["all"] == "4/4"
    assert list(data["summaries"]["streams"]["ours"]) == ["all", "depth=1", "depth=2", "activation=gelu",
                                                          "momentum=True", "chunk_size=4", "scale=1.0",
                                                          "scale=1000.0", "gates=init", "gates=worst",
                                                          "dtype=float32"]
    assert all(r["tokens"] == 48 for r in data["streams"] if r["finite"])
    assert "| all | 8/8 |" in result.output


def test_worst_gates_run_away_only_under_the_papers_rule():
    cases = [StreamCase(rule, 2, "gelu", True, 16, 1000.0, "worst", "float32") for rule in ("ours", "paper")]
    ours, paper = (run_stream(c, tokens=512, train_tokens=0) for c in cases)
    assert ours.finite and ours.max_state_norm <= 10.0 * (1 + 1e-5)
    assert not paper.finite and paper.max_state_norm == float("inf") and paper.tokens < 512 + 4096
    assert summarize([ours, paper], ["depth"]) == {"ours": {"all": "1/1", "depth=2": "1/1"},
                                                   "paper": {"all": "0/1", "depth=2": "0/1"}}
    assert "outputs and states finite in 1/1 streams" in describe_streams([ours, paper], "ours")
    assert describe_streams([ours, paper], "paper").endswith(
        "not finite: depth 2 gelu momentum on chunk 16 scale 1000 worst float32 (outputs or states)")


def test_streams_train_exactly_the_first_train_tokens_and_record_their_gradients(monkeypatch):
    """The backward passes cover the first `train_tokens` tokens (a piece ends there), the rest streams without
    gradients; the largest gradient entry is recorded (0 where nothing trained)."""
    calls, forward = [], NeuralMemory.forward

    def spy(self, x, state=None):
        calls.append((x.shape[1], torch.is_grad_enabled()))
        return forward(self, x, state)

    monkeypatch.setattr(NeuralMemory, "forward", spy)
    case = StreamCase("ours", 1, "gelu", True, 4, 1.0, "init", "float32")
    trained = run_stream(case, tokens=40, train_tokens=12, piece=16)
    assert calls == [(12, True), (16, False), (12, False)]
    assert trained.finite and trained.forward_finite and trained.tokens == 40
    assert 0 < trained.max_grad < math.inf
    assert run_stream(case, tokens=40, train_tokens=0, piece=16).max_grad == 0.0


def test_training_sweep_runs_count_steps_and_stop_at_divergence():
    ours = run_training(TrainCase("ours", 2, 1000.0, 0.1), steps=20)
    assert ours.finite and ours.steps == 20 and 0 < ours.final_loss < float("inf")
    paper = run_training(TrainCase("paper", 2, 1000.0, 0.1), steps=20)
    assert not paper.finite and paper.steps < 20 and paper.final_loss == float("inf")
