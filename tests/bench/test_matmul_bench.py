"""`titans bench matmul` at toy sizes: both orientations, both sources, positive rates; bad options rejected."""

from typer.testing import CliRunner

from titans.bench.matmul import measure
from titans.cli import app
from titans.memory import state_ops


def test_measure_covers_both_orientations_and_sources():
    points = measure(rows=4, d_in=8, d_out=32, batch=2, dram_mib=1, repeats=1)
    # 4 rows and a width of 8: shapes the kernel does not serve, so ATen alone
    assert [(p.shape, p.implementation, p.source) for p in points] == [
        ("[4×8]·[8×32]", "ATen bmm", "cache"), ("[4×8]·[8×32]", "ATen bmm", "DRAM"),
        ("[4×32]·[32×8]", "ATen bmm", "cache"), ("[4×32]·[32×8]", "ATen bmm", "DRAM")]
    for p in points:
        assert p.micros > 0 and p.gflops > 0
        # the rates are the same measurement seen two ways: flops and state bytes per second
        assert abs(p.gflops * 1e9 / (2 * 4) - p.state_gib_s * 2**30 / 4) < 1e-6 * p.gflops * 1e9


def test_measure_puts_the_kernel_beside_aten_where_it_serves_the_shape():
    points = measure(rows=16, d_in=16, d_out=32, batch=2, dram_mib=1, repeats=1)
    implementations = ["ATen bmm"] + (["titans kernel"] if state_ops.state_kernels() is not None else [])
    assert sorted({p.implementation for p in points}) == implementations
    assert len(points) == 4 * len(implementations) and all(p.gflops > 0 for p in points)


def test_cli_prints_table_and_bandwidth():
    result = CliRunner().invoke(app, ["bench", "matmul", "--rows", "4", "--d-in", "8", "--d-out", "16",
                                      "--batch", "1", "--dram-mib", "1", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    assert result.output.count("| [4×") == 4 and "streaming read (sum over 1 MiB)" in result.output


def test_cli_rejects_bad_sizes():
    result = CliRunner().invoke(app, ["bench", "matmul", "--rows", "0"])
    assert result.exit_code != 0 and "rows" in result.output
