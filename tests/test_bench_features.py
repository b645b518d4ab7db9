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
