"""Benchmark outputs: CSV (the attention suite's columns, or any suite's rows), JSON, PNG charts,
the attention table, merging saved runs."""
import csv
import json
import math
import os
import sys


FLOPS_NOTE = ("FLOPs: fwd 4*B*H*Sq*Sk*D (halved when causal and Sq == Sk), bwd 2.5x fwd, "
              "fwd_bwd 3.5x fwd; TF/s = FLOPs / median time; ours/X = time(X) / time(ours) "
              "(> 1: ours is faster)")


# The first fourteen columns are the CSV of the original bench script, in its order and
# number format; scripts read them by name.
CSV_FIELDS = ["dtype", "hdim", "B", "H", "Sq", "S", "causal", "pass_", "backend", "ms", "tflops",
              "ours_speedup", "peak_extra_mb", "note", "layout", "flops", "min_bytes", "intensity",
              "bound", "roof_pct", "Hk", "hdim_v"]


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def csv_row(r):
    """One result row as the CSV's strings (CSV_FIELDS)."""
    return dict(dtype=r["dtype"], hdim=r["hdim"], B=r["B"], H=r["H"], Sq=r["Sq"], S=r["S"],
                causal=r["causal"], pass_=r["pass_"], backend=r["backend"], ms=_fmt(r["ms"], ".4g"),
                tflops=_fmt(r["tflops"], ".4g"), ours_speedup=_fmt(r["ours_speedup"], ".2f"),
                peak_extra_mb=_fmt(r["peak_extra_mb"], ".1f"), note=r["note"], layout=r["layout"],
                flops=_fmt(r["flops"], ".6g"), min_bytes=r["min_bytes"],
                intensity=_fmt(r["intensity"], ".4g"), bound=r["bound"] or "",
                roof_pct=_fmt(r["roof_pct"], ".1f"), Hk=r.get("Hk", r["H"]),
                hdim_v=r.get("hdim_v", r["hdim"]))


def write_csv(rows, path):
    """Every row to a CSV file (columns CSV_FIELDS)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(csv_row(r) for r in rows)


def write_rows_csv(rows, path, fields=None, formats=None):
    """Rows (dicts) of any suite to a CSV file: columns `fields` (default: the first row's
    keys, in order), numbers formatted by formats[field] (a format spec) where given, None as
    an empty cell."""
    fields = fields or list(rows[0])
    formats = formats or {}
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r[k], formats[k]) if k in formats else r[k] for k in fields})


def write_json(rows, meta, path):
    """{"meta": meta, "rows": rows} to a JSON file (what --merge reads back)."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def write_plots(rows, out_dir):
    """TF/s vs seqlen and peak extra memory vs seqlen: one PNG per (quantity, pass, layout),
    one panel per (causal, head dim), one line per backend. Returns the files written."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); no charts written",
              file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []
    if not any(r["peak_extra_mb"] is not None for r in rows):
        print("--plot: no memory numbers (measured on CUDA only): no memory_*.png", file=sys.stderr)
    layouts = sorted({r["layout"] for r in rows})
    for p in dict.fromkeys(r["pass_"] for r in rows):
        for layout in layouts:
            sub = [r for r in rows if r["pass_"] == p and r["layout"] == layout]
            suffix = f"_{layout}" if len(layouts) > 1 else ""
            for key, ylabel, name in (("tflops", "TFLOP/s", "tflops"),
                                      ("peak_extra_mb", "peak extra memory (MB)", "memory")):
                if not any(r[key] for r in sub):
                    continue
                panels = sorted({(r["causal"], r["hdim"]) for r in sub})
                ncols = len({d for _, d in panels})
                nrows = len({c for c, _ in panels})
                fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.6 * nrows),
                                         squeeze=False)
                hd = sorted({d for _, d in panels})
                cs = sorted({c for c, _ in panels})
                for (c, d) in panels:
                    ax = axes[cs.index(c)][hd.index(d)]
                    for be in dict.fromkeys(r["backend"] for r in sub):
                        pts = sorted((r["S"], r[key]) for r in sub
                                     if r["backend"] == be and r["causal"] == c and r["hdim"] == d
                                     and r[key])
                        if pts:
                            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=be)
                    ax.set_xscale("log", base=2)
                    ticks = sorted({r["S"] for r in sub})
                    ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)
                                          for t in ticks])
                    ax.minorticks_off()
                    if key == "peak_extra_mb":
                        ax.set_yscale("log")  # naive grows as S^2, ours as S: spans decades
                    else:
                        ax.set_ylim(bottom=0)
                    ax.set_title(f"{p}, D={d}, causal={c}")
                    ax.set_xlabel("seqlen (keys)")
                    ax.set_ylabel(ylabel)
                    ax.grid(True, alpha=0.3)
                    ax.legend(fontsize="small")
                dt = sub[0]["dtype"]
                fig.suptitle(f"{ylabel}, {dt}, layout {layout}")
                fig.tight_layout()
                path = os.path.join(out_dir, f"{name}_{p}{suffix}.png")
                fig.savefig(path, dpi=110)
                plt.close(fig)
                written.append(path)
    return written


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def print_table(rows, meta):
    """The summary table on stdout, one line per (pass, layout, D, causal, S), then the
    "geomean ours/<backend>" lines (their format is grep'ed by bench/tune_tiles.sh)."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    others = [b for b in backends if b != "ours"]
    roofline = meta.get("peaks") is not None
    by = {}
    for r in rows:
        # H shows "query heads/kv heads" under GQA (--heads-k; runs saved before it have no Hk).
        heads = r["H"] if r.get("Hk", r["H"]) == r["H"] else f"{r['H']}/{r['Hk']}"
        # D shows "qk/v" where v's head dim differs (--hdim-v).
        dims = r["hdim"] if r.get("hdim_v", r["hdim"]) == r["hdim"] else f"{r['hdim']}/{r['hdim_v']}"
        key = (r["pass_"], r["dtype"], r["layout"], dims, r["B"], heads, r["Sq"], r["S"], r["causal"])
        by.setdefault(key, {})[r["backend"]] = r
    pass_order = list(dict.fromkeys(r["pass_"] for r in rows))
    keys = sorted(by, key=lambda t: (pass_order.index(t[0]), t[2], str(t[3]).zfill(8), t[8], t[7],
                                     t[6]))
    # Memory is measured on CUDA only: no columns of dashes on the CPU.
    mem_cols = [b for b in ("ours", "naive") if b in backends and
                any(r["peak_extra_mb"] is not None for r in rows if r["backend"] == b)]
    header = ["pass", "dtype", "layout", "D", "B", "H", "Sq", "Sk", "causal"] + \
        (["ours ms"] if "ours" in backends else []) + [f"{b} TF/s" for b in backends] + \
        [f"ours/{b}" for b in others if "ours" in backends] + [f"{b} MB" for b in mem_cols]
    if roofline:
        header += ["FLOP/B", "bound", "ours %roof"]
    print("\n" + " | ".join(header))
    ratios = {b: [] for b in others}
    per_pass = {}
    for key in keys:
        res = by[key]
        cells = [key[0], key[1], key[2]] + [str(x) for x in key[3:]]
        ours = res.get("ours")
        if "ours" in backends:
            cells.append(_fmt(ours["ms"], ".4g") if ours and ours["ms"] else "-")
        for b in backends:
            r = res.get(b)
            cells.append(_fmt(r["tflops"], ".4g") if r and r["tflops"] else
                         ((r["note"] if r else "")[:20] or "-"))
        if ours is not None:
            for b in others:
                r = res.get(b)
                if ours["ms"] and r and r["ms"]:
                    ratio = r["ms"] / ours["ms"]
                    ratios[b].append(ratio)
                    per_pass.setdefault((b, key[0]), []).append(ratio)
                    cells.append(f"{ratio:.2f}")
                else:
                    cells.append("-")
        for b in mem_cols:
            r = res.get(b)
            cells.append(_fmt(r["peak_extra_mb"], ".1f") if r and r["peak_extra_mb"] is not None else "-")
        if roofline:
            any_r = next(iter(res.values()))
            cells += [f"{any_r['intensity']:.4g}", any_r["bound"] or "-",
                      _fmt(ours["roof_pct"], ".0f") if ours and ours["roof_pct"] else "-"]
        print(" | ".join(cells))
    # The "geomean ours/<backend>:" lines are grep'ed by bench/tune_tiles.sh: keep their format.
    for b, rs in ratios.items():
        if rs:
            print(f"geomean ours/{b}: {_geomean(rs):.3f} (min {min(rs):.2f}, {len(rs)} configs)")
    passes = list(dict.fromkeys(k[0] for k in keys))
    if len(passes) > 1:
        for b in others:
            parts = [f"{p} {_geomean(per_pass[(b, p)]):.3f} (min {min(per_pass[(b, p)]):.2f}, "
                     f"max {max(per_pass[(b, p)]):.2f})" for p in passes if per_pass.get((b, p))]
            if parts:
                print(f"  per pass, ours/{b}: " + "; ".join(parts))


def load_runs(paths):
    """Rows and metadata of earlier --json outputs, concatenated (metadata of the first)."""
    rows, meta = [], None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        meta = meta or data["meta"]
    return rows, meta
