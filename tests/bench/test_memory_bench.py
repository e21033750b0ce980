"""`titans bench memory` end to end at toy sizes: every point runs in its own subprocess and reports numbers."""

import json
import os

from typer.testing import CliRunner

from titans.bench.memory import BenchPoint, best_of, format_table
from titans.cli import app
from titans.machine import describe_machine


def test_bench_runs_points_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "memory", "--lengths", "16,40", "--dim", "8", "--expansion", "2", "--chunk-size", "4",
            "--batch", "2", "--warmup", "0", "--repeats", "1", "--no-reference", "--out", str(out)]
    for extra in ([], ["--release-memory"]):
        result = CliRunner().invoke(app, args + extra)
        assert result.exit_code == 0, result.output
        data = json.loads(out.read_text())
        assert data["machine"] == describe_machine() and data["command"].startswith("titans ")  # argv: pytest's
        assert data["setup"]["dim"] == 8 and data["rounds"] == 1
        points = data["points"]
        assert [(p["impl"], p["seq_len"], p["status"]) for p in points] == [("titans", 16, "ok"), ("titans", 40, "ok")]
        assert all(p["fwd_tok_s"] > 0 and p["fwd_bwd_tok_s"] > 0 and p["peak_mib"] >= 0 for p in points)
        assert ("MALLOC_MMAP_THRESHOLD_" in result.output) == bool(extra)
        assert f"machine: {describe_machine()}" in result.output


def test_table_has_a_ratio_only_where_both_ran():
    ours = BenchPoint("titans", 512, 4, fwd_tok_s=4000.0, fwd_bwd_tok_s=2000.0, peak_mib=900.0)
    ref = BenchPoint("reference", 512, 4, fwd_tok_s=500.0, fwd_bwd_tok_s=200.0, peak_mib=4000.0)
    oom = BenchPoint("reference", 8192, 4, status="out of memory")
    long = BenchPoint("titans", 8192, 4, fwd_tok_s=4000.0, fwd_bwd_tok_s=1800.0, peak_mib=1500.0)
    rows = format_table([ours, ref, long, oom]).splitlines()[2:]
    assert rows[0].endswith("| 10.0x |") and "out of memory" in rows[1] and rows[1].endswith("| - |")


def test_rounds_alternate_and_keep_the_best_of_each(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "memory", "--lengths", "16", "--dim", "8", "--expansion", "2",
                                      "--chunk-size", "4", "--batch", "2", "--warmup", "0", "--repeats", "1",
                                      "--rounds", "2", "--no-reference", "--paper-rule", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.count("      titans seq     16: ok") == 2 and "best of 2 round(s)" in result.output
    assert result.output.count("titans-paper seq     16: ok") == 2
    assert [(p["impl"], p["seq_len"]) for p in json.loads(out.read_text())["points"]] == [("titans", 16),
                                                                                  ("titans-paper", 16)]
    cost = result.output.splitlines()[-2]  # the rule-cost table's row, before "wrote ..."
    assert cost.startswith("| 16 |") and float(cost.split("|")[-2]) > 0


def test_best_of_takes_the_fastest_runs_and_the_highest_peak():
    runs = [BenchPoint("titans", 512, 4, fwd_tok_s=10.0, fwd_bwd_tok_s=3.0, peak_mib=700.0),
            BenchPoint("titans", 512, 4, status="timeout (> 900 s)"),
            BenchPoint("titans", 512, 4, fwd_tok_s=8.0, fwd_bwd_tok_s=4.0, peak_mib=750.0)]
    best = best_of(runs)
    assert (best.status, best.fwd_tok_s, best.fwd_bwd_tok_s, best.peak_mib) == ("ok", 10.0, 4.0, 750.0)
    failed = [BenchPoint("reference", 4096, 4, status="out of memory")] * 2
    assert best_of(failed).status == "out of memory"


def test_machine_description_names_the_cpu(tmp_path):
    """Tables say which machine made them: model, family, AVX-512, CPU count; without /proc what platform knows."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                       "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512bw\n\n"
                       "processor\t: 1\nmodel name\t: something else\n")
    assert describe_machine(cpuinfo) == f"AMD EPYC (cpu family 26, model 2, AVX-512), {os.cpu_count()} CPUs"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2\n")
    assert describe_machine(cpuinfo) == f"Some CPU, {os.cpu_count()} CPUs"
    assert describe_machine(tmp_path / "missing").endswith(f", {os.cpu_count()} CPUs")


def test_bench_selects_the_implementation_and_refuses_unknown_ones(tmp_path):
    args = ["bench", "memory", "--lengths", "16", "--dim", "8", "--expansion", "2", "--chunk-size", "4", "--batch", "1",
            "--warmup", "0", "--repeats", "1", "--no-reference"]
    result = CliRunner().invoke(app, args + ["--implementation", "autograd"])
    assert result.exit_code == 0, result.output
    assert "on cpu, implementation autograd" in result.output
    for bad in (["--implementation", "cuda"], ["--device", "tpu"]):
        result = CliRunner().invoke(app, args + bad)
        assert result.exit_code != 0 and bad[1] in result.output


def test_bench_compares_implementations_in_one_run(tmp_path):
    """Several implementations: each measured at every length, one table with each one's tokens/s and its fwd+bwd
    ratio to the first; the reference is not run."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "memory", "--lengths", "16", "--dim", "8", "--expansion", "2",
                                      "--chunk-size", "4", "--batch", "1", "--warmup", "0", "--repeats", "1",
                                      "--implementation", "fused,autograd", "--out", str(out)])
    assert result.exit_code == 0, result.output
    points = json.loads(out.read_text())["points"]
    assert [(p["impl"], p["status"]) for p in points] == [("titans:fused", "ok"), ("titans:autograd", "ok")]
    header, _, row = result.output.splitlines()[-4:-1]  # the table, before "wrote ..."
    assert header.startswith("| seq | fused fwd tok/s |") and header.endswith("| fwd+bwd, autograd / fused |")
    ratio = points[1]["fwd_bwd_tok_s"] / points[0]["fwd_bwd_tok_s"]
    assert row.startswith("| 16 |") and row.endswith(f"| {ratio:.2f} |")


def test_bench_measures_the_losses_beside_the_squared_loss_in_one_run(tmp_path):
    """`--loss`: our memory under each loss, alternating with the squared loss as rounds do, and a table of each one's
    forward+backward tokens/s against the squared loss's."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "memory", "--lengths", "16", "--dim", "8", "--expansion", "2",
                                      "--chunk-size", "4", "--batch", "1", "--warmup", "0", "--repeats", "1",
                                      "--no-reference", "--loss", "huber:gated=true", "--out", str(out)])
    assert result.exit_code == 0, result.output
    points = json.loads(out.read_text())["points"]
    assert [(p["impl"], p["status"]) for p in points] == [("titans", "ok"), ("titans-loss:huber:gated=true", "ok")]
    header, _, row = result.output.splitlines()[-4:-1]
    assert header == "| seq | squared fwd+bwd tok/s | huber:gated=true fwd+bwd tok/s | huber:gated=true / squared |"
    assert row.startswith("| 16 |") and all(float(cell) > 0 for cell in row.strip("|").split("|")[1:])


def test_bench_refuses_a_loss_it_does_not_know_naming_it():
    from titans.bench.memory import parse_losses

    assert parse_losses("huber, lp:p=4:eps=1e-4") == {"huber": {"name": "huber"},
                                                       "lp:p=4:eps=1e-4": {"name": "lp", "p": 4, "eps": 1e-4}}
    args = ["bench", "memory", "--lengths", "16", "--dim", "8", "--no-reference"]
    for bad, message in (("quartic", "name must be one of"), ("lp:p=1", "loss.p: must be > 1"),
                         ("huber:delta", "key=value"), (",", "names no loss")):
        result = CliRunner().invoke(app, args + ["--loss", bad])
        assert result.exit_code != 0 and message in result.output, result.output
