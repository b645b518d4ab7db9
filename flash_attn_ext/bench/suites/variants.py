"""The variants suite (formerly bench/bench_variants.py): times the attention variants (sliding
window, softcap, ALiBi, attn_mask, dropout, sink) against our plain kernel,
torch.compile(flex_attention) with the equivalent block_mask / score_mod and torch's cuDNN
backend where it runs the same thing, in one process, and prints the table last. Ratios, not
absolute times, are the result.

  python -m flash_attn_ext.bench variants                       # GPU, bf16, D=128
  python -m flash_attn_ext.bench variants --rounds 3 --csv variants.csv
  python -m flash_attn_ext.bench variants --device cpu --quick  # CPU smoke run (tiny sizes, no flex)

Configs (H=16, D=128, flash-attn's bottom-right diagonal; Sq = Sk, so top-left is the same):
  window   B=1, S=16k, causal: full causal vs window_size=(4096, 0) (each query sees <= 4097
           keys). The FLOP ratio of the two is 2.29x, the most a kernel that skips the
           tiles outside the window can gain at equal efficiency.
  softcap  B=4, S=4k, causal and not: softcap=30 vs plain
  alibi    B=4, S=4k, causal and not: alibi_slopes [H] (2^(-8 h / H)) vs plain
  mask     B=4, S=4k: a boolean key-padding attn_mask [B, 1, 1, S] (a quarter of each row's
           keys masked) and an additive bf16 bias [1, H, S, S], through our SDPA entry point
  dropout  B=4, S=4k, causal and not: dropout_p = 0.1
  sink     B=2, S=8k, causal and not: learnable_sink [H] (gpt-oss's sinks; requires grad, so
           the backward computes d_sink too). gpt-oss's head dim is 64: --head-dim 64.
Backends: ours (flash_attn_ext with the variant), plain (ours without it: the same call minus
the variant), flex (torch.compile(flex_attention), fresh compile per config; no dropout),
flex_plain (flex_attention on the plain call: its causal block_mask only, no score_mod; not in
the default set: flex_plain/plain is how much slower flex's kernel is than ours on the same
work, so the most that flex/ours can reach for a variant that costs either side nothing),
cudnn (torch SDPA pinned to cuDNN: with the same attn_mask / dropout_p where it takes them,
else the plain causal / full call, a reference point only). flex has no sinks (no row can get
an extra logit without a value).
Passes: fwd, and bwd alone (torch.autograd.grad with retain_graph=True on a forward built
before timing), through flash_attn_ext.bench.timing.time_passes. Timing:
flash_attn_ext.bench.time_ms (do_bench median, L2 flushed); with --rounds N every config runs
N times with the backends in rotated order (flash_attn_ext.bench.rotated_rounds) and the median
of the rounds is reported.
Columns: ms per backend; var/plain = time(ours) / time(plain) (the variant's cost, 1.0 = free;
for the window row this is the window's speed-up inverted: plain/var is printed as
'speedup'); flex/ours = time(flex) / time(ours) (above 1 ours is faster).
"""
import argparse
import functools
import importlib
import sys

import torch
import torch.nn.functional as F

import flash_attn_ext as fa
from ..report import write_rows_csv
from ..timing import require_cuda, rotated_rounds, time_passes

PASSES = ("fwd", "bwd")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flash_attn_ext.bench variants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every config, rotating backends")
    p.add_argument("--backends", default="ours,plain,flex,cudnn")
    p.add_argument("--csv", default=None, help="write every row to this CSV file")
    p.add_argument("--only", default=None,
                   help="comma-separated variants to run (window, softcap, alibi, mask, dropout, "
                   "sink)")
    return p.parse_args(argv)


def configs(quick):
    S_win, W, S = (512, 128, 256) if quick else (16384, 4096, 4096)
    B_win, B = (1, 2) if quick else (1, 4)
    out = [dict(name="window", B=B_win, S=S_win, causal=True, window=(W, 0))]
    for causal in (False, True):
        out.append(dict(name="softcap", B=B, S=S, causal=causal, softcap=30.0))
        out.append(dict(name="alibi", B=B, S=S, causal=causal, alibi=True))
    out.append(dict(name="mask", B=B, S=S, causal=False, mask="padding"))
    out.append(dict(name="mask", B=B, S=S, causal=False, mask="bias"))
    for causal in (False, True):
        out.append(dict(name="dropout", B=B, S=S, causal=causal, dropout=0.1))
    S_sink, B_sink = (256, 2) if quick else (8192, 2)
    for causal in (False, True):
        out.append(dict(name="sink", B=B_sink, S=S_sink, causal=causal, sink=True))
    return out


def attn_mask(cfg, H, device, dtype):
    """The config's attn_mask (None without): key padding (bool [B, 1, 1, S]: batch entry b
    attends to its first 3S/4..S keys) or an additive bias [1, H, S, S]."""
    kind, B, S = cfg.get("mask"), cfg["B"], cfg["S"]
    if kind is None:
        return None
    gen = torch.Generator(device="cpu").manual_seed(1)
    if kind == "padding":
        lengths = torch.randint(3 * S // 4, S + 1, (B,), generator=gen)
        return (torch.arange(S).view(1, 1, 1, S) < lengths.view(B, 1, 1, 1)).to(device)
    return torch.randn(1, H, S, S, generator=gen).to(device, dtype)


def alibi_slopes(H, device):
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device=device)


def make_fn(backend, cfg, H, device, dtype):
    """fn(q, k, v) on [B, H, S, D] tensors -> out [B, H, S, D]."""
    if backend == "flex_plain":  # the plain call: the config without its variant
        return make_fn("flex", {k: cfg[k] for k in ("name", "B", "S", "causal")}, H, device,
                       dtype)
    causal = cfg["causal"]
    window = cfg.get("window", (-1, -1))
    softcap = cfg.get("softcap", 0.0)
    slopes = alibi_slopes(H, device) if cfg.get("alibi") else None
    mask = attn_mask(cfg, H, device, dtype)
    dropout_p = cfg.get("dropout", 0.0)
    # gpt-oss's sinks: a parameter, so the backward also computes its gradient.
    sink = (torch.randn(H, device=device).requires_grad_() if cfg.get("sink") and
            backend == "ours" else None)
    if cfg.get("sink") and backend == "flex":
        raise RuntimeError("flex_attention has no sinks")
    if backend in ("ours", "plain") and (mask is not None or dropout_p > 0):
        kw = dict(is_causal=causal)
        if backend == "ours":
            kw.update(attn_mask=mask, dropout_p=dropout_p)
        return lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, **kw)
    if backend in ("ours", "plain"):
        kw = dict(causal=causal)
        if backend == "ours":
            kw.update(window_size=window, softcap=softcap, alibi_slopes=slopes,
                      learnable_sink=sink)

        def ours(q, k, v):
            out = fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
            return out.transpose(1, 2)
        return ours
    if backend == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                      dropout_p=dropout_p)
        return cudnn
    if backend == "flex":
        if device != "cuda":
            raise RuntimeError("flex_attention is benchmarked on CUDA only")
        if dropout_p > 0:
            raise RuntimeError("flex_attention has no dropout")
        fx = importlib.import_module("torch.nn.attention.flex_attention")
        torch._dynamo.reset()  # a fresh compile per config (see flash_attn_ext.bench.backends)
        compiled = torch.compile(fx.flex_attention, dynamic=False)
        S = cfg["S"]
        left = window[0]

        padding = mask if cfg.get("mask") == "padding" else None

        def visible(b, h, qi, ki):
            keep = qi >= ki if causal else qi == qi
            if left >= 0:
                keep = keep & (qi - ki <= left)
            if padding is not None:
                keep = keep & padding[b, 0, 0, ki]
            return keep
        block_mask = None
        if causal or left >= 0 or padding is not None:
            block_mask = fx.create_block_mask(visible, cfg["B"] if padding is not None else None,
                                              None, S, S, device=device)
        score_mod = None
        if cfg.get("mask") == "bias":
            def score_mod(s, b, h, qi, ki):
                return s + mask[0, h, qi, ki]
        elif softcap > 0:
            def score_mod(s, b, h, qi, ki):
                return softcap * torch.tanh(s / softcap)
        elif slopes is not None:
            def score_mod(s, b, h, qi, ki):
                return s - slopes[h] * (qi - ki).abs()
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, score_mod=score_mod)
    raise ValueError(f"unknown backend {backend!r}")


def _describe_error(e):
    # This suite's notes: the exception's first line, 50 characters (kept from its first form).
    return f"{type(e).__name__}: {str(e).splitlines()[0][:50]}"


def time_backend(backend, cfg, sets, H, device, dtype):
    """{pass: (median ms or None, note)} of one backend on one config."""
    make = functools.partial(make_fn, backend, cfg, H, device, dtype)
    res = time_passes(make, sets, PASSES, device, _describe_error)
    return {p: (r["ms"], r["note"]) for p, r in res.items()}


def label(cfg):
    extra = (f"window {cfg['window'][0]}" if "window" in cfg else
             f"softcap {cfg['softcap']:g}" if "softcap" in cfg else
             f"mask {cfg['mask']}" if "mask" in cfg else
             f"dropout {cfg['dropout']:g}" if "dropout" in cfg else
             "sink" if "sink" in cfg else "alibi")
    return f"{extra}, {'causal' if cfg['causal'] else 'full'}"


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    if device == "cuda":
        require_cuda("variants --device cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if device == "cpu":
        dtype = torch.float32
    backends = [b for b in args.backends.split(",") if b]
    if device == "cpu":
        backends = [b for b in backends if b not in ("flex", "flex_plain", "cudnn")]
    H, D = (4, 64) if args.quick else (16, args.head_dim)
    rows = []
    wanted = set(args.only.split(",")) if args.only else None
    for cfg in configs(args.quick):
        if wanted is not None and cfg["name"] not in wanted:
            continue
        gen = torch.Generator(device="cpu").manual_seed(0)
        sets = [tuple(torch.randn(cfg["B"], H, cfg["S"], D, generator=gen).to(device, dtype)
                      .requires_grad_() for _ in range(3)) for _ in range(2)]
        done = dict.fromkeys(backends, 0)  # rounds each backend has run (progress lines)

        # The inputs as a default argument: the del below frees them with this function.
        def time_one(b, first_round, sets=sets):
            res = time_backend(b, cfg, sets, H, device, dtype)
            done[b] += 1
            print(f"  {label(cfg)} round {done[b]}: {b} done", file=sys.stderr, flush=True)
            return {p: {"ms": ms, "note": note} for p, (ms, note) in res.items()}
        results = rotated_rounds(backends, time_one, args.rounds)
        for p in PASSES:
            row = dict(config=label(cfg), B=cfg["B"], H=H, S=cfg["S"], D=D, dtype=args.dtype,
                       pass_=p)
            for b in backends:
                row[b] = results[b][p]["ms"]
                row[b + "_note"] = results[b][p]["note"]
            rows.append(row)
        del sets, time_one
    if args.csv:
        write_rows_csv(rows, args.csv)

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"
    print(f"\nVariants, {str(dtype).replace('torch.', '')}, D={D}, H={H}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, rounds {args.rounds}")
    head = f"{'config':<22}{'pass':<5}" + "".join(f"{b:>9}" for b in backends) + \
        f"{'var/plain':>11}{'flex/ours':>11}" + (f"{'flexP/plain':>12}" if "flex_plain" in backends else "")
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = "".join(f"{r[b]:9.3f}" if r[b] else f"{'-':>9}" for b in backends)
        vp = ratio(r.get("ours"), r.get("plain"))
        if r["config"].startswith("window") and r.get("ours") and r.get("plain"):
            vp = f"x{r['plain'] / r['ours']:.2f}"  # the window's speed-up over full causal
        flex_plain = f"{ratio(r.get('flex_plain'), r.get('plain')):>12}" if "flex_plain" in backends else ""
        print(f"{r['config']:<22}{r['pass_']:<5}{cells}{vp:>11}{ratio(r.get('flex'), r.get('ours')):>11}"
              f"{flex_plain}")
        for b in backends:
            if r[b + "_note"]:
                print(f"    {b}: {r[b + '_note']}")
    print("var/plain: time(ours) / time(plain), x: plain / ours (window speed-up); "
          "flex/ours > 1: ours faster; flexP/plain: flex_plain / plain")

