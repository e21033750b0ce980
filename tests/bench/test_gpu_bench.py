"""`titans bench gpu`: the GPU script's benchmarks at toy sizes on the CPU (what DRY=1 docs/bench/gpu/run.sh runs),
their JSON and the summary table; the kernels' FLOP count against a count by hand."""

import json

import pytest
import torch
from typer.testing import CliRunner

from titans.bench.gpu import QUICK_MODEL, decode_point, kernel_flops, summary
from titans.cli import app
from titans.memory.triton_chunk import Geometry


def test_quick_run_writes_one_json_per_benchmark_and_the_summary(tmp_path):
    result = CliRunner().invoke(app, ["bench", "gpu", "--quick", "--device", "cpu", "--only", "matmul,layer,model",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for name in ("matmul", "layer", "model"):
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["benchmark"] == name and record["quick"] and record["command"].startswith("titans bench gpu")
        assert {"torch", "triton", "gpu", "device"} <= set(record["environment"])
    layer = json.loads((tmp_path / "layer.json").read_text())["results"]
    assert {p["kind"] for p in layer} >= {"titans", "titans-channels", "sdpa"}
    assert all(p["status"] == "ok" for p in layer)
    assert all(p["fwd_bwd_tok_s"] > 0 for p in layer)
    model = json.loads((tmp_path / "model.json").read_text())["results"]
    assert [p["variant"] for p in model] == ["transformer", "lmm", "mac", "mag", "mal"]
    table = summary(tmp_path)
    assert "x SDPA" in table and "α per channel" in table and "model T 64: transformer" in table
    assert table in result.output  # the table the command prints last


def test_decode_points_go_through_the_static_decoder_and_name_their_path(tmp_path):
    """Off a GPU the static step runs eagerly ("static", no graph); the summary names the path."""
    points = [decode_point(variant, QUICK_MODEL, 24, 1, 2, torch.device("cpu")) for variant in ("transformer", "lmm")]
    assert all(p["status"] == "ok" and p["path"] == "static" and p["graphs"] == 0 and p["decode_tok_s"] > 0
               for p in points), points
    (tmp_path / "decode.json").write_text(json.dumps({"results": points, "environment": {}}))
    assert "decode batch 1 (static): transformer" in summary(tmp_path)


def test_the_full_sizes_are_refused_without_a_gpu(tmp_path):
    result = CliRunner().invoke(app, ["bench", "gpu", "--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--quick" in result.output


@pytest.mark.parametrize("replay", [False, True])
def test_kernel_flops_count_each_layer_as_the_docstring_says(replay):
    """depth 2, 4 → 8 → 4, chunk 16: P = 32 per layer; forward 6 (first layer) or 7 products of 2P per token, twice
    with replay, backward 13 or 16."""
    geo = Geometry(2, 4, 8, 4)
    forward = (6 + 7) * (2 if replay else 1)
    assert kernel_flops(geo, 16, replay) == 2 * 32 * (forward + 13 + 16)
    assert kernel_flops(geo, 8, replay) == 2 * kernel_flops(geo, 16, replay)  # 8 tokens padded to 16 rows
