"""The benchmark CLI, the profiler script and the Hugging Face example run end to end on the
CPU (tiny sizes; no timing assertions)."""
import csv
import importlib
import json
import os
import subprocess
import sys

import pytest

from flash_attn_ext import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, cwd):
    # cwd outside the source tree, so the installed flash_attn_ext is the one imported.
    proc = subprocess.run([sys.executable] + args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_cli_outputs(tmp_path):
    csv_path, json_path, plot_dir = tmp_path / "b.csv", tmp_path / "b.json", tmp_path / "plots"
    proc = run(["-m", "flash_attn_ext.bench", "--device", "cpu", "--hdims", "32", "--seqlens", "64",
                "--batch", "1", "--heads", "2", "--pass", "fwd,bwd", "--csv", str(csv_path),
                "--json", str(json_path), "--plot", str(plot_dir)], cwd=tmp_path)
    out = proc.stdout
    assert "FLOPs: fwd 4*B*H*Sq*Sk*D" in out and "measured peaks:" in out
    header = next(line for line in out.splitlines() if line.startswith("pass | "))
    for col in ("ours TF/s", "naive TF/s", "math TF/s", "sdpa TF/s", "ours/sdpa", "FLOP/B", "bound"):
        assert col in header
    # The table comes last: its rows and geomean lines end stdout.
    tail = out.strip().splitlines()[-6:]
    assert any(line.startswith("geomean ours/sdpa: ") for line in tail)

    rows = list(csv.DictReader(open(csv_path)))
    assert len(rows) == 2 * 4 * 2  # causal x backends x passes
    assert {r["backend"] for r in rows} == {"ours", "naive", "math", "sdpa"}
    assert all(float(r["ms"]) > 0 and float(r["tflops"]) > 0 for r in rows)
    assert all(r["bound"] in ("compute", "memory") for r in rows)

    data = json.loads(json_path.read_text())
    assert data["meta"]["flops_convention"].startswith("FLOPs:")
    assert data["meta"]["peak_tflops"] > 0 and data["meta"]["peak_gbps"] > 0
    assert len(data["rows"]) == len(rows)

    try:
        importlib.import_module("matplotlib")
        have_matplotlib = True
    except ImportError:
        have_matplotlib = False
    if have_matplotlib:
        pngs = sorted(p.name for p in plot_dir.iterdir())
        assert pngs == ["tflops_bwd.png", "tflops_fwd.png"]  # no memory numbers on the CPU
        assert all((plot_dir / p).stat().st_size > 1000 for p in pngs)
    else:
        assert "matplotlib is not installed" in proc.stderr


def test_bench_layouts_deterministic_and_unavailable_backends(capsys):
    rows = bench.main(["--device", "cpu", "--hdims", "16", "--seqlens", "48", "--seqlen-q", "16",
                       "--batch", "2", "--heads", "2", "--causal", "1", "--pass", "fwd_bwd",
                       "--layout", "bshd,bhsd", "--backends", "ours,naive,flex", "--deterministic",
                       "--no-roofline"])
    assert len(rows) == 2 * 3
    by = {(r["layout"], r["backend"]): r for r in rows}
    for layout in ("bshd", "bhsd"):
        assert by[(layout, "ours")]["ms"] > 0 and by[(layout, "naive")]["ms"] > 0
        assert by[(layout, "flex")]["ms"] is None and "CUDA only" in by[(layout, "flex")]["note"]
    out = capsys.readouterr().out
    assert "geomean ours/naive: " in out and "measured peaks" not in out


def test_bench_merge_json_runs(tmp_path, capsys):
    one = str(tmp_path / "one.json")
    bench.main(["--device", "cpu", "--hdims", "16", "--seqlens", "32", "--batch", "1", "--heads", "1",
                "--causal", "0", "--pass", "fwd", "--backends", "ours,naive", "--no-roofline",
                "--json", one])
    rows = bench.main(["--merge", one, one, "--csv", str(tmp_path / "all.csv")])
    assert len(rows) == 4
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("geomean ours/naive: ")


def test_naive_backend_matches_ours():
    # The baseline computes the same function (top-left causal, Sq != Sk included).
    import torch
    cfg = dict(layout="bshd", D=16, Sq=24, Sk=40, causal=True, B=1, H=2)
    (q, k, v), = bench.make_inputs(cfg, "bshd", 1, "cpu", torch.float32)
    for be in ("naive", "math"):
        ref = bench.make_fn(be, cfg, "cpu")(q, k, v)
        for det in (False, True):
            out = bench.make_fn("ours", cfg, "cpu", deterministic=det)(q, k, v)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(os.path.join(ROOT, "bench"))
                                           if f.endswith((".py", ".sh"))))
def test_bench_script_help(script, tmp_path):
    """Every entry point in bench/ answers --help (and does nothing else)."""
    path = os.path.join(ROOT, "bench", script)
    if script.endswith(".sh"):
        proc = subprocess.run(["bash", path, "--help"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert f"bash bench/{script}" in proc.stdout
    else:
        proc = run([path, "--help"], cwd=tmp_path)
        assert proc.stdout.startswith("usage:")
    assert os.listdir(tmp_path) == []


def test_profiler_cpu_trace(tmp_path):
    trace = tmp_path / "trace" / "t.json"
    proc = run([os.path.join(ROOT, "bench", "profile_attention.py"), "--device", "cpu", "--hdim", "32",
                "--seqlen", "128", "--batch", "1", "--heads", "2", "--warmup", "1", "--iters", "2",
                "--trace", str(trace)], cwd=tmp_path)
    assert "flash_attn_ext::fwd" in proc.stdout and "flash_attn_ext::bwd" in proc.stdout
    assert "Self CPU" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("flash_attn_ext::bwd" in e.get("name", "") for e in events)


def test_profiler_ncu_command(tmp_path):
    proc = run([os.path.join(ROOT, "bench", "profile_attention.py"), "--device", "cpu", "--ncu",
                "--pass", "bwd"], cwd=tmp_path)
    assert "--set full" in proc.stdout and "bwd_main" in proc.stdout and "--plain" in proc.stdout


NCU_SAMPLE = """==PROF== Connected to process 1234
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1234","python3","127.0.0.1","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 64, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","12.5"
"0","1234","python3","127.0.0.1","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 64, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","ns","41,216"
"0","1234","python3","127.0.0.1","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 64, 1)","0","9.0","GPU Speed Of Light Throughput","Compute (SM) Throughput","%","71.3"
"0","1234","python3","127.0.0.1","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 64, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","255"
"0","1234","python3","127.0.0.1","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 64, 1)","0","9.0","Launch Statistics","Static Shared Memory Per Block","byte/block","0"
"0","1234","python3","127.0.0.1","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 64, 1)","0","9.0","Launch Statistics","Dynamic Shared Memory Per Block","byte/block","49,152"
"0","1234","python3","127.0.0.1","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 64, 1)","0","9.0","Occupancy","Achieved Occupancy","%","6.2"
"0","1234","python3","127.0.0.1","flash_fwd_kernel","1","7","(128, 1, 1)","(8, 64, 1)","0","9.0","Command line profiler metrics","smsp__sass_inst_executed_op_local_st.sum","inst","0"
"1","1234","python3","127.0.0.1","bwd_main_kernel","1","7","(256, 1, 1)","(8, 64, 1)","0","9.0","Occupancy","Achieved Occupancy","%","12.4"
==PROF== Disconnected from process 1234
"""


def test_ncu_summary_parser():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import profile_attention
    finally:
        sys.path.pop(0)
    rows = profile_attention.summarise_ncu(profile_attention.parse_ncu_csv(NCU_SAMPLE))
    assert [r["kernel"] for r in rows] == ["flash_fwd_kernel", "bwd_main_kernel"]
    fwd = rows[0]
    assert fwd["regs/thread"] == 255 and fwd["smem/block B"] == 49152 and fwd["local st"] == 0
    assert fwd["SM %"] == pytest.approx(71.3) and fwd["DRAM %"] == pytest.approx(12.5)
    assert fwd["time us"] == pytest.approx(41.216) and fwd["local ld"] is None
    assert rows[1]["occupancy %"] == pytest.approx(12.4) and rows[1]["regs/thread"] is None
    profile_attention.print_ncu_summary(rows)


def test_hf_gpt_oss_example(tmp_path):
    """gpt-oss's sinks and sliding window through flash_attn_ext under transformers: the same
    loss and gradients (the sinks' included) as transformers' eager attention."""
    pytest.importorskip("transformers")
    proc = run([os.path.join(ROOT, "examples", "hf_gpt_oss.py"), "--device", "cpu", "--seqlen",
                "160", "--window", "64"], cwd=tmp_path)
    assert proc.stdout.strip().endswith("OK")
    assert "max |d sinks diff|" in proc.stdout


def test_deepseek_mla_example(tmp_path):
    """MLA's training form (192 / 128) against torch's attention and its absorbed decode (576 /
    512, contiguous and paged latent caches) against the training form."""
    proc = run([os.path.join(ROOT, "examples", "deepseek_mla.py"), "--device", "cpu",
                "--seqlen", "40", "--heads", "4"], cwd=tmp_path)
    assert proc.stdout.strip().endswith("OK")
    assert "absorbed decode (paged latent cache" in proc.stdout


def test_hf_llama_example(tmp_path):
    pytest.importorskip("transformers")
    proc = run([os.path.join(ROOT, "examples", "hf_llama.py"), "--device", "cpu", "--seqlen", "64"],
               cwd=tmp_path)
    assert proc.stdout.strip().endswith("OK")
    assert "greedy generation, 12 new tokens: identical" in proc.stdout
    assert "padded batch (8 left-padding tokens): max |logits diff| vs sdpa" in proc.stdout
    assert "greedy generation, static cache, left-padded batch: identical" in proc.stdout


def test_narrowed_build_reports_missing_kernels_as_skips(tmp_path):
    """conftest.py: with FLASH_ATTN_EXT_HEAD_DIMS / _DTYPES set (a narrowed build), a test that
    fails only because its kernel is not compiled is a skip; any other error, and the same error
    without those variables (a full build), stays a failure."""
    import shutil
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_narrowed.py").write_text(
        "def test_missing_kernel():\n"
        "    raise RuntimeError('flash_attn_ext: head_dim 32 (kernel head dim 32) is not compiled'\n"
        "                       ' in this build (FLASH_ATTN_EXT_HEAD_DIMS=64,128)')\n"
        "def test_other_error():\n"
        "    raise RuntimeError('flash_attn_ext: something else')\n")

    def outcome(**env):
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("FLASH_ATTN_EXT_HEAD_DIMS", "FLASH_ATTN_EXT_DTYPES")}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               "test_narrowed.py"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**full_env, **env})
        return proc.stdout

    narrowed = outcome(FLASH_ATTN_EXT_HEAD_DIMS="64,128")
    assert "1 failed, 1 skipped" in narrowed, narrowed[-2000:]
    assert "narrowed build: flash_attn_ext: head_dim 32" in narrowed
    full = outcome()
    assert "2 failed" in full, full[-2000:]
