"""Benchmark backends: the callables each backend runs (ours, naive, torch SDPA pinned to one
backend, flex_attention, FlashAttention-4), their inputs, FLOP and byte counts, and env helpers."""
import contextlib
import importlib
import math
import os

import torch
import torch.nn.functional as F

import flash_attn_ext as fa


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


ALL_BACKENDS = ("ours", "ours-mma", "ours-det", "naive", "sdpa", "math", "flash", "efficient", "cudnn",
                "flex", "fa4")


# Backends from packages that may be missing: the module each needs and how to get it.
OPTIONAL_BACKENDS = {"fa4": ("flash_attn.cute", "pip install flash-attn-4")}


def missing_backend(backend):
    """None when `backend` can run here, else a one-line reason (its package is missing)."""
    if backend not in OPTIONAL_BACKENDS:
        return None
    module, install = OPTIONAL_BACKENDS[backend]
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a package that fails at import (no CUDA, ...)
        return f"{backend} skipped: {module} does not import ({type(e).__name__}; {install})"
    return None


SDPA_BACKENDS = ("math", "flash", "efficient", "cudnn")


# Backends that materialise the [Sq, Sk] score matrix: checked against free memory first.
QUADRATIC_BACKENDS = ("naive", "math")


PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def flops(cfg, pass_):
    """FLOPs of one call in FlashAttention's convention: fwd 4*B*H*Sq*Sk*D (halved when
    causal and Sq == Sk), bwd 2.5x that, fwd_bwd 3.5x; cfg has B, H, Sq, Sk, D, causal (and
    Dv, v's head dim, where it is not D: fwd 2*B*H*Sq*Sk*(D + Dv))."""
    f = 2.0 * cfg["B"] * cfg["H"] * cfg["Sq"] * cfg["Sk"] * (cfg["D"] + cfg.get("Dv", cfg["D"]))
    if cfg["causal"] and cfg["Sq"] == cfg["Sk"]:
        f /= 2
    return f * PASS_FLOP_FACTOR[pass_]


def min_bytes(cfg, pass_, elt):
    """Bytes that any implementation has to move through DRAM at least once (elt bytes per
    element): fwd reads q [B, H, Sq, D], k, v [B, Hk, Sk, D] and writes o; bwd also reads o
    and do and writes dq, dk, dv."""
    D, Dv = cfg["D"], cfg.get("Dv", cfg["D"])
    q_like = cfg["B"] * cfg["H"] * cfg["Sq"] * (D + Dv) * elt // 2  # q, o, do, dq
    k_like = cfg["B"] * cfg.get("Hk", cfg["H"]) * cfg["Sk"] * (D + Dv) * elt // 2  # k, v, dk, dv
    fwd = 2 * q_like + 2 * k_like                # read q, k, v; write o
    bwd = 4 * q_like + 4 * k_like                # read q, k, v, o, do; write dq, dk, dv
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[pass_]


def _sdpa_backend_enum(name):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def _causal_mask(Sq, Sk, device):
    # Top-left aligned (torch SDPA's is_causal): key j is hidden from query i when j > i.
    return torch.ones(Sq, Sk, dtype=torch.bool, device=device).triu(1)


def make_fn(backend, cfg, device, deterministic=False):
    """fn(q, k, v) -> out for one backend (ALL_BACKENDS) on config cfg (D, Sq, Sk, causal,
    H, Hk): q [B, H, Sq, D], k, v [B, Hk, Sk, D] (possibly transposed views, see
    make_inputs) -> out [B, H, Sq, D]; causal is top-left aligned (SDPA's is_causal) for every
    backend; Hk < H (GQA) goes to SDPA and flex_attention as enable_gqa=True, to naive
    attention as repeated k, v, and to ours and FA4 as it is."""
    causal, Sq, Sk = cfg["causal"], cfg["Sq"], cfg["Sk"]
    scale = 1.0 / math.sqrt(cfg["D"])
    gqa = cfg.get("Hk", cfg["H"]) != cfg["H"]
    gqa_kw = {"enable_gqa": True} if gqa else {}
    if backend == "ours-mma":
        # ours with both passes pinned to the mma.sync kernels (on sm_90 the default is the
        # Hopper wgmma kernels); run_config times it inside _pinned_to_mma().
        return make_fn("ours", cfg, device, deterministic)
    if backend == "ours-det":  # ours with deterministic=True, beside ours in the same run
        return make_fn("ours", cfg, device, True)
    if backend == "ours":
        if not deterministic:
            return lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                   **gqa_kw)

        # The SDPA wrapper has no deterministic flag; flash_attn_func has, but aligns causal
        # masks bottom-right. For Sq <= Sk, top-left causal attention (the other backends')
        # never sees keys past Sq, and on the first Sq keys both alignments coincide.
        if causal and Sq > Sk:
            raise NotImplementedError("--deterministic with causal and seqlen_q > seqlen_k")
        n_keys = Sq if causal else Sk

        def ours_det(q, k, v):
            out = fa.flash_attn_func(q.transpose(1, 2), k[:, :, :n_keys].transpose(1, 2),
                                     v[:, :, :n_keys].transpose(1, 2), causal=causal,
                                     deterministic=True)
            return out.transpose(1, 2)
        return ours_det
    if backend == "naive":
        # What attention looks like written out in PyTorch, in the input dtype (softmax
        # accumulates in fp32 internally). flash_attn_ext.attention_ref is the test
        # reference instead: it upcasts and guards empty rows, which is not the baseline
        # people would write.
        mask = _causal_mask(Sq, Sk, device) if causal else None

        def naive(q, k, v):
            if gqa:  # what a model without GQA support does: repeat k and v per query head
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            s = torch.matmul(q, k.transpose(-2, -1)) * scale
            if mask is not None:
                s = s.masked_fill(mask, float("-inf"))
            return torch.matmul(torch.softmax(s, dim=-1), v)
        return naive
    if backend == "sdpa":  # torch's own choice (on CPU: its flash-attention CPU kernel)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                              **gqa_kw)
    if backend in SDPA_BACKENDS:
        from torch.nn.attention import sdpa_kernel
        be = _sdpa_backend_enum(backend)

        def pinned(q, k, v):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa_kw)
        return pinned
    if backend == "flex":
        if device != "cuda":
            raise RuntimeError("flex_attention is benchmarked on CUDA only")
        fx = importlib.import_module("torch.nn.attention.flex_attention")
        # A fresh compile per config: every shape is a recompile, and past dynamo's recompile
        # limit flex_attention would silently run unfused (eager), timing the wrong thing.
        torch._dynamo.reset()
        compiled = torch.compile(fx.flex_attention, dynamic=False)
        block_mask = None
        if causal:  # top-left, as SDPA's is_causal
            block_mask = fx.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, Sq, Sk,
                                              device=device)
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, **gqa_kw)
    if backend == "fa4":
        # FlashAttention-4's CuTe DSL kernels, in their own layout [B, S, H, D]: the bshd
        # layout's inputs are such views already (bhsd ones are copied by FA4 first). It
        # compiles each shape on its first call, which the probe call and do_bench's first
        # call absorb before any timed call.
        if causal and Sq != Sk:  # FA4, like flash-attn, aligns causal masks bottom-right
            raise NotImplementedError("fa4 with causal and seqlen_q != seqlen_k")
        fa4_func = importlib.import_module("flash_attn.cute").flash_attn_func

        def fa4(q, k, v):
            out = fa4_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           softmax_scale=scale, causal=causal)
            out = out[0] if isinstance(out, tuple) else out  # (out, lse) in FA4 4.0
            return out.transpose(1, 2)
        return fa4
    raise ValueError(f"unknown backend {backend!r}")


def quadratic_bytes(backend, cfg, pass_, elt):
    """Rough upper bound of what naive / math attention allocate: a few score-sized matrices
    in the forward (scores, masked scores, probabilities), about twice as many when the
    backward runs. The math backend may upcast half inputs, so count 4 bytes for it."""
    n = cfg["B"] * cfg["H"] * cfg["Sq"] * cfg["Sk"] * (4 if backend == "math" else elt)
    return n * (3 if pass_ == "fwd" else 6)


@contextlib.contextmanager
def env_set(values):
    """os.environ updated with `values` (name -> str) while active, then restored. Our env
    switches are read on every call, so this also covers a backward that autograd runs after
    the forward returned."""
    previous = {n: os.environ.get(n) for n in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for n, value in previous.items():
            if value is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = value


def _pinned_to_mma(active=True):
    """FLASH_ATTN_EXT_FWD_IMPL / _BWD_IMPL = mma while active."""
    names = ("FLASH_ATTN_EXT_FWD_IMPL", "FLASH_ATTN_EXT_BWD_IMPL")
    return env_set({n: "mma" for n in names} if active else {})


def make_inputs(cfg, layout, n_sets, device, dtype, seed=0):
    """n_sets independent (q, k, v), q [B, H, Sq, D]- and k, v [B, Hk, Sk, D]-shaped; for
    layout bshd these are transposed views of [B, S, heads, D] storage, as a model using
    flash-attn's layout has them."""
    gen = torch.Generator().manual_seed(seed)
    B = cfg["B"]
    sets = []
    for _ in range(n_sets):
        t = []
        for n, H, D in ((cfg["Sq"], cfg["H"], cfg["D"]), (cfg["Sk"], cfg.get("Hk", cfg["H"]), cfg["D"]),
                        (cfg["Sk"], cfg.get("Hk", cfg["H"]), cfg.get("Dv", cfg["D"]))):
            shape = (B, H, n, D) if layout == "bhsd" else (B, n, H, D)
            x = torch.randn(shape, generator=gen).to(device, dtype)
            if layout == "bshd":
                x = x.transpose(1, 2)
            t.append(x.requires_grad_())
        sets.append(tuple(t))
    return sets
