"""The varlen and decode suites (formerly bench/bench_features.py) run end to end (--quick, CPU)
and write their CSV; no timing assertions."""
import csv

import pytest

fa = pytest.importorskip("flash_attn_ext")
if not (hasattr(fa, "flash_attn_varlen_func") and hasattr(fa, "flash_attn_with_kvcache")):
    pytest.skip("flash_attn_ext has no flash_attn_varlen_func / flash_attn_with_kvcache",
                allow_module_level=True)

from flash_attn_ext.bench import main  # noqa: E402


def test_bench_features_cpu_quick(tmp_path, capsys):
    rows = []
    for suite in ("varlen", "decode"):
        csv_path, json_path = tmp_path / f"{suite}.csv", tmp_path / f"{suite}.json"
        main([suite, "--device", "cpu", "--quick", "--no-peaks", "--csv", str(csv_path),
              "--json", str(json_path)])
        out = capsys.readouterr().out
        assert f"{suite} geomean ours/" in out
        with open(csv_path, newline="") as f:
            suite_rows = list(csv.DictReader(f))
        assert {r["section"] for r in suite_rows} == {suite}
        assert json_path.exists()
        rows += suite_rows
    varlen = [r for r in rows if r["section"] == "varlen"]
    decode = [r for r in rows if r["section"] == "decode"]
    # 1 head dim x 2 causal x 2 passes per varlen backend; 2 cache lengths per decode backend.
    assert {r["backend"] for r in varlen} >= {"ours", "ours_padded", "sdpa_flash"}
    assert len(varlen) % 8 == 0 and len(varlen) >= 8 * 3
    assert {r["backend"] for r in decode} >= {"ours", "sdpa_flash", "sdpa_math", "best_sdpa"}
    # Ours and the CPU references were timed; CUDA-only backends carry a note instead.
    for r in rows:
        if r["backend"] in ("ours", "sdpa_flash", "best_sdpa"):
            assert float(r["ms"]) > 0, r
            assert r["ours_speedup"], r
        if r["backend"] in ("sdpa_cudnn", "sdpa_efficient") or r["backend"].startswith("varlen"):
            assert r["ms"] == "" and r["note"], r
    assert all(float(r["gbps"]) > 0 for r in decode if r["backend"] == "ours")


def test_bench_varlen_lengths_and_tokens(tmp_path, capsys):
    csv_path = tmp_path / "varlen.csv"
    main(["varlen", "--device", "cpu", "--quick", "--no-peaks", "--tokens", "300",
          "--lengths", "20:60", "--csv", str(csv_path)])
    capsys.readouterr()
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    # (the last length is dropped when under LO: at most 19 tokens short)
    assert rows and all(281 <= int(r["tokens"]) <= 300 for r in rows)
    assert all(int(r["Sq"]) <= 60 for r in rows)
    assert all(int(r["B"]) >= 5 for r in rows)  # 300 tokens of at most 60 each


@pytest.mark.parametrize("args", [["--lengths", "60"], ["--lengths", "60:20"],
                                  ["--lengths", "0:20"], ["--tokens", "0"]])
def test_bench_varlen_bad_lengths(args):
    with pytest.raises(SystemExit):
        main(["varlen", "--device", "cpu", "--quick", "--no-peaks", *args])
