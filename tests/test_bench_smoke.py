"""The benchmark script runs end to end (tiny sizes, CPU); no timing assertions."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import bench_attention  # noqa: E402


def test_bench_cpu_smoke(tmp_path, capsys):
    csv_path = tmp_path / "out.csv"
    bench_attention.main(["--device", "cpu", "--hdims", "16", "--seqlens", "32", "--batch", "1",
                          "--heads", "2", "--pass", "fwd,bwd,fwd_bwd", "--csv", str(csv_path)])
    out = capsys.readouterr().out
    assert "geomean ours/sdpa" in out
    n_backends = len("ours,naive,math,sdpa".split(","))  # the CPU default
    # header + causal x backends x passes
    assert csv_path.read_text().count("\n") == 1 + 2 * n_backends * 3
