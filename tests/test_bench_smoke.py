"""The benchmark entry point and its suites run end to end (tiny sizes, CPU); no timing
assertions. bench/bench_attention.py (the README's set-up command) is the attention suite."""
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import bench_attention  # noqa: E402
from flash_attn_ext.bench import SUITES, main  # noqa: E402


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
    """The ring suite spawns gloo worlds of 1 and 2 ranks (tiny shards) and writes its table;
    it drives the ring's private pieces (the no-communication ring), which this keeps honest."""
    from flash_attn_ext.bench.suites import ring
    csv_path = tmp_path / "ring.csv"
    ring.main(["--device", "cpu", "--all", "--max-world", "2", "--seqlen", "32",
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


# ---- the entry point: one suite per first argument ---------------------------------------------

@pytest.mark.parametrize("suite", list(SUITES))
def test_suite_help(suite, capsys):
    """`python -m flash_attn_ext.bench <suite> --help` describes that suite."""
    with pytest.raises(SystemExit) as e:
        main([suite, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    usage = out.splitlines()[0]
    assert usage.startswith("usage: python -m flash_attn_ext.bench")
    assert suite in usage  # attention's reads "[attention]"
    assert "--csv" in out


def test_help_lists_suites(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for suite in SUITES:
        assert f"\n  {suite} " in out, suite
    assert "--hdims" in out  # and the default suite's flags


def test_unknown_suite_message():
    with pytest.raises(SystemExit) as e:
        main(["no-such-suite"])
    assert "unknown suite 'no-such-suite'" in str(e.value.code)


def _table_tail(out, n=4):
    return "\n".join(out.strip().splitlines()[-n:])


# Each CPU-runnable suite at its smallest, and what the end of stdout (its table) holds.
CPU_RUNS = {
    "attention": (["--device", "cpu", "--quick"], "geomean ours/sdpa"),
    "variants": (["--device", "cpu", "--quick"], "var/plain: time(ours) / time(plain)"),
    "host-overhead": (["--device", "cpu", "--calls", "20", "--rounds", "1"],
                      "flash_attn_with_kvcache"),
    "paged-prefill": (["--device", "cpu", "--quick"], "paged256"),
    "mla-decode": (["--device", "cpu", "--quick"], "paged16"),
    "decode": (["--device", "cpu", "--quick", "--no-peaks"], "decode geomean ours/best_sdpa"),
    "varlen": (["--device", "cpu", "--quick", "--no-peaks"], "varlen geomean ours/sdpa_flash"),
}


@pytest.mark.parametrize("suite", list(CPU_RUNS))
def test_suite_cpu_runs(suite, tmp_path, capsys):
    """Every suite that runs on the CPU prints its table last and writes its CSV."""
    args, table_line = CPU_RUNS[suite]
    csv_path = tmp_path / f"{suite}.csv"
    main([suite] + args + ["--csv", str(csv_path)])
    out = capsys.readouterr().out
    assert table_line in _table_tail(out), out[-2000:]
    lines = csv_path.read_text().splitlines()
    assert len(lines) >= 2 and "," in lines[0]


# Suites, or --device cuda, that need a GPU: one line naming the suite, no traceback.
CUDA_ONLY = [["fp8"], ["varlen-variants"], ["--device", "cuda", "--quick"],
             ["decode", "--device", "cuda"], ["variants", "--device", "cuda"],
             ["paged-prefill", "--device", "cuda"], ["host-overhead", "--device", "cuda"],
             ["mla-decode", "--device", "cuda"],
             ["ring", "--device", "cuda", "--all"]]


@pytest.mark.parametrize("argv", CUDA_ONLY, ids=lambda a: " ".join(a))
def test_cuda_suites_exit_cleanly_without_cuda(argv, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    message = str(e.value.code)
    assert "needs a CUDA device" in message
    assert message.startswith(argv[0] if not argv[0].startswith("-") else "attention")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_suite_message_not_traceback(tmp_path):
    """As a command: exit status 1, the message on stderr, no traceback. (The installed
    package: the source tree has no built extension after a non-editable install.)"""
    proc = subprocess.run([sys.executable, "-m", "flash_attn_ext.bench", "fp8"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "fp8: needs a CUDA device" in proc.stderr and "Traceback" not in proc.stderr


def test_dtype_fp8_hands_over_to_the_fp8_suite():
    """--dtype fp8 runs the fp8 suite: the attention suite's options translated (ours = the FP8
    forward and our bf16 forward; backends without an FP8 column dropped with a notice)."""
    from flash_attn_ext.bench.cli import fp8_suite_args, parse_args
    from flash_attn_ext.bench.suites import fp8
    args = parse_args(["--device", "cuda", "--dtype", "fp8", "--hdims", "128", "--seqlens", "8192",
                       "--causal", "1", "--rounds", "2", "--backends", "ours,cudnn,flex,fa4",
                       "--csv", "x.csv"])
    argv = fp8_suite_args(args)
    assert argv == ["--rounds", "2", "--causal", "1", "--head-dims", "128", "--seqlens", "8192",
                    "--backends", "fp8,bf16,cudnn,fa4", "--csv", "x.csv"]
    suite_args = fp8.parse_args(argv)
    assert (suite_args.causal, suite_args.head_dims, suite_args.backends) == ("1", "128",
                                                                             "fp8,bf16,cudnn,fa4")
    assert fp8.parse_args([]).backends == "fp8,bf16,cudnn,fa2,fa4"


@pytest.mark.parametrize("argv,match", [
    (["--device", "cpu", "--dtype", "fp8"], "Hopper GPUs"),
    (["--device", "cuda", "--dtype", "fp8", "--pass", "bwd"], "forward only"),
    (["--device", "cuda", "--dtype", "fp8", "--backends", "flex"], "runs ours")])
def test_dtype_fp8_bad_options(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(argv)


def test_dtype_fp8_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="fp8: needs a CUDA device"):
        main(["--device", "cuda", "--dtype", "fp8"])
