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


def test_rotated_rounds_order_and_median():
    from flash_attn_ext.bench import rotated_rounds
    calls = []
    fake_ms = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, None, 4.0]), "c": iter([None] * 3)}

    def time_one(name, first_round):
        calls.append((name, first_round))
        return {"fwd": {"ms": next(fake_ms[name]), "note": name}}

    res = rotated_rounds(["a", "b", "c"], time_one, 3)
    # Round r starts at the r-th name: every name once in every position.
    assert [n for n, _ in calls] == list("abc" "bca" "cab")
    assert [f for _, f in calls] == [True] * 3 + [False] * 6
    assert res["a"]["fwd"]["ms"] == 2.0  # median of 3, 1, 2
    assert res["b"]["fwd"]["ms"] == 4.5  # a failed round (None) is left out
    assert res["c"]["fwd"]["ms"] is None and res["c"]["fwd"]["note"] == "c"


def test_bench_cpu_rounds(tmp_path, capsys):
    bench_attention.main(["--device", "cpu", "--hdims", "16", "--seqlens", "32", "--batch", "1",
                          "--heads", "2", "--causal", "0", "--pass", "fwd", "--backends",
                          "ours,naive", "--rounds", "2", "--no-roofline"])
    out = capsys.readouterr().out
    assert "median of 2 round(s)" in out and "geomean ours/naive" in out


def test_bench_ring_cpu_smoke(tmp_path, capsys):
    """bench_ring.py spawns gloo worlds of 1 and 2 ranks (tiny shards) and writes its table;
    it drives the ring's private pieces (the no-communication ring), which this keeps honest."""
    import bench_ring
    csv_path = tmp_path / "ring.csv"
    bench_ring.main(["--device", "cpu", "--all", "--max-world", "2", "--seqlen", "32",
                     "--iters", "1", "--warmup", "1", "--csv", str(csv_path)])
    out = capsys.readouterr().out
    assert "scaling %" in out
    assert csv_path.read_text().count("\n") == 1 + 2  # header + worlds 1 and 2


def test_bench_optional_backend_missing(monkeypatch, capsys):
    """An optional backend whose package does not import (fa4 without flash-attn-4) is
    dropped with a one-line notice; the others still run."""
    from flash_attn_ext.bench import backends
    monkeypatch.setitem(backends.OPTIONAL_BACKENDS, "fa4",
                        ("flash_attn_ext_no_such_module", "pip install flash-attn-4"))
    rows = bench_attention.main(["--device", "cpu", "--hdims", "16", "--seqlens", "32",
                                 "--batch", "1", "--heads", "2", "--causal", "0", "--pass", "fwd",
                                 "--backends", "ours,fa4", "--no-roofline"])
    captured = capsys.readouterr()
    notices = [line for line in captured.err.splitlines() if line.startswith("fa4 skipped")]
    assert len(notices) == 1 and "pip install flash-attn-4" in notices[0]
    assert {r["backend"] for r in rows} == {"ours"}


def test_bench_gqa_cpu(capsys):
    """--heads-k: k and v with fewer heads (GQA) for every backend (SDPA with enable_gqa,
    naive attention with repeated k / v); the table shows the heads as H/Hk."""
    rows = bench_attention.main(["--device", "cpu", "--hdims", "16", "--seqlens", "32",
                                 "--batch", "1", "--heads", "4", "--heads-k", "2", "--causal", "1",
                                 "--pass", "fwd,bwd", "--backends", "ours,naive,math,sdpa",
                                 "--no-roofline"])
    assert {r["Hk"] for r in rows} == {2} and all(r["ms"] for r in rows), rows
    assert " | 4/2 | " in capsys.readouterr().out
