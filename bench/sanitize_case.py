"""Small cases of every CUDA kernel, for compute-sanitizer (memcheck / racecheck):
forward (full, causal, split-KV + combine), fp32 forward/backward, backward
(atomic and deterministic dQ), odd lengths and a padded head dim; then the
variable-sequence instantiations: GQA, varlen (with an empty sequence),
seqused_k, the KV-cache decode path and a KV-cache prefill chunk (paged, cache_batch_idx, cache_leftpad);
last the split-KV merge both ways (on sm_90 up to 6
16-bit decode-tile splits merge inside a thread-block cluster, more take the combine kernel),
also on the 4-key-warp decode tile. On sm_90 the unsplit 16-bit forward cases run
the Hopper kernel (two more cases give its persistent loop several tiles per CTA; the
16-bit varlen cases its packed-sequence instance; last the FP8 forward, padded (V
transposed in the kernel, and by the pass for a longer call) and varlen), and the
16-bit backward cases with head dim 40, 64, 128 or 256 the Hopper backward (deterministic,
varlen and seqused_k included). Last, v head dims of their own: 192 / 128 (fwd + bwd) and
MLA's 576 / 512 forward (latent cache, separate v, paged decode).

  compute-sanitizer --tool memcheck python bench/sanitize_case.py
"""
import argparse

import torch

import flash_attn_ext as fa

parser = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.parse_args()
torch.manual_seed(0)
cases = [  # (dtype, seqlen_q, seqlen_k, head_dim, causal, num_splits, deterministic)
    (torch.bfloat16, 130, 130, 64, False, 1, False),
    (torch.float16, 77, 201, 128, True, 1, True),
    (torch.bfloat16, 1, 700, 128, True, 4, False),
    (torch.bfloat16, 70, 90, 256, True, 1, False),
    (torch.float16, 65, 65, 40, False, 1, False),
    (torch.float32, 70, 90, 64, True, 1, False),
    (torch.float16, 150, 300, 128, True, 1, False),  # Hopper backward, 3 query tiles, D = 128
    (torch.bfloat16, 200, 150, 256, False, 1, False),  # Hopper backward, head-dim split, 4 q tiles
    (torch.bfloat16, 333, 200, 64, True, 1, False),  # Hopper backward, 6 q tiles: both dQ buffers reused
]
for dtype, sq, sk, d, causal, splits, det in cases:
    q = torch.randn(1, sq, 2, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(1, sk, 2, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(1, sk, 2, d, device="cuda", dtype=dtype, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, causal=causal, num_splits=splits, deterministic=det)
    out.backward(torch.randn_like(out))

# Hopper forward: 4 * 40 heads * 2 query tiles = 320 tiles > SMs, so each persistent
# CTA loops (Q reloaded after the last Q K^T, ring phases and the ping-pong turn carried
# across tiles); non-causal with the static schedule, causal with the dynamic one
# (tile counter).
q, k, v = (torch.randn(4, 200, 40, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
fa.flash_attn_func(q, k, v, num_splits=1)
fa.flash_attn_func(q, k, v, causal=True, num_splits=1)

# Variable sequences: varlen fwd+bwd (GQA 2:1, a zero-length sequence), seqused_k fwd+bwd,
# KV-cache append + regrouped GQA decode with split-KV, in 16-bit and fp32.
for dtype in (torch.bfloat16, torch.float32):
    lens_q, lens_k = [5, 0, 70, 33], [9, 4, 70, 0]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 64, device="cuda", dtype=dtype, requires_grad=True)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    out.backward(torch.randn_like(out))
    q = torch.randn(3, 20, 4, 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(3, 50, 1, 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(3, 50, 1, 64, device="cuda", dtype=dtype, requires_grad=True)
    used = torch.tensor([0, 17, 50], dtype=torch.int32, device="cuda")
    out = fa.flash_attn_func(q, k, v, causal=True, seqused_k=used)
    out.backward(torch.randn_like(out))
# seqused_k on the Hopper forward (sm_90; else mma.sync): padded, with NaN in the keys and
# values past it (a cache's unused rows: the last key tile's V rows are zeroed in shared
# memory), and packed, D 64/128/256.
for head_dim in (64, 128, 256):
    used = torch.tensor([333, 0, 129, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(4, 150, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 333, 2, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for b, n in enumerate(used.tolist()):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    for causal in (False, True):
        out = fa.flash_attn_func(q, k, v, causal=causal, seqused_k=used, num_splits=1)
    cu = torch.tensor([0, 100, 400], dtype=torch.int32, device="cuda")
    qv = torch.randn(400, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(400, 2, head_dim, device="cuda", dtype=torch.bfloat16)
    out = fa.flash_attn_varlen_func(qv, kv, kv, cu, cu, 300, 300, causal=True,
                                    seqused_k=torch.tensor([50, 257], dtype=torch.int32,
                                                           device="cuda"))
# A KV-cache prefill chunk (150 queries) on the Hopper forward (sm_90; else mma.sync): a paged
# cache in 16- and 256-row pages (TMA boxes per page piece / whole tiles), table entries past a
# sequence -1, cache_batch_idx and cache_leftpad, D 64/128/256.
for head_dim in (64, 128, 256):
    used = torch.tensor([333, 0, 129, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(4, 150, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    for page in (16, 256):
        pages = -(-333 // page)
        k_pool = torch.randn(4 * pages + 1, page, 2, head_dim, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(4 * pages, device="cuda").view(4, pages).to(torch.int32)
        table[1:, -1] = -1
        out = fa.flash_attn_with_kvcache(q, k_pool, k_pool, cache_seqlens=used, block_table=table,
                                         causal=True)
    k_cache = torch.randn(5, 333, 2, head_dim, device="cuda", dtype=torch.bfloat16)
    idx = torch.tensor([4, 0, 2, 1], dtype=torch.int32, device="cuda")
    out = fa.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=used, cache_batch_idx=idx)
    pad = torch.tensor([7, 0, 100, 1], dtype=torch.int32, device="cuda")
    out = fa.flash_attn_with_kvcache(q, k_cache[:4], k_cache[:4], cache_seqlens=used,
                                     cache_leftpad=pad, causal=True)
# Hopper backward, deterministic (dQ adds handed from CTA to CTA through counters) over
# 140 heads (several waves of CTAs), then varlen / seqused_k at D = 64, 128 and 256 (rows past
# a sequence zeroed in shared memory).
for d, sq, sk in ((64, 300, 300), (128, 300, 300), (256, 200, 150)):
    q, k, v = (torch.randn(2, s, 70, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for s in (sq, sk, sk))
    out = fa.flash_attn_func(q, k, v, causal=True, deterministic=True)
    out.backward(torch.randn_like(out))
    lens_q, lens_k = [5, 0, 130, 33], [9, 4, 70, 200]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 4, d, device="cuda", dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, d, device="cuda", dtype=torch.float16, requires_grad=True)
            for _ in range(2))
    for det in (False, True):
        out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                        deterministic=det)
        out.backward(torch.randn_like(out))
    q, k, v = (torch.randn(3, s, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for s in (70, 200, 200))
    out = fa.flash_attn_func(q, k, v, seqused_k=torch.tensor([0, 77, 200], dtype=torch.int32,
                                                             device="cuda"))
    out.backward(torch.randn_like(out))
k_cache = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
v_cache = torch.randn_like(k_cache)
q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
k_new, v_new = (torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                           cache_seqlens=torch.tensor([10, 250], dtype=torch.int32, device="cuda"),
                           num_splits=3)
# Paged caches (pages of 16 keys, a shuffled block table; 16-bit and FP8) and cache_batch_idx:
# the decode tiles look each K/V tile's rows up in the table right before its copies.
pages = torch.randperm(64, device="cuda", dtype=torch.int32).reshape(2, 32)
lens = torch.tensor([37, 500], dtype=torch.int32, device="cuda")
for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
    pool_k, pool_v = (torch.randn(64, 16, 2, 128, device="cuda").to(cache_dtype) for _ in range(2))
    descale = {} if cache_dtype == torch.bfloat16 else dict(
        k_descale=torch.ones((), device="cuda"), v_descale=torch.ones((), device="cuda"))
    fa.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=pages,
                               **descale)
# FP8 caches on the key-warp tile (tile=3, 2 splits) and at D = 256 (Q re-read from shared
# memory each tile), fp16 and bf16 q.
for d, tile, qdtype in ((128, 3, torch.bfloat16), (256, 1, torch.float16), (64, 3, torch.float16)):
    q8 = torch.randn(2, 1, 8, d, device="cuda", dtype=qdtype)
    k8, v8 = (torch.randn(2, 300, 2, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    one = torch.ones((), device="cuda")
    torch.ops.flash_attn_ext.fwd(q8, k8, v8, d ** -0.5, False, True, 2, tile,
                                 lens.clamp(max=300), k_descale=one, v_descale=one)
fa.flash_attn_with_kvcache(q, k_cache.repeat(2, 1, 1, 1), v_cache.repeat(2, 1, 1, 1),
                           cache_seqlens=lens.clamp(max=300),
                           cache_batch_idx=torch.tensor([3, 0], dtype=torch.int32, device="cuda"))
q = torch.randn(1, 1, 2, 128, device="cuda", dtype=torch.float16)
k, v = (torch.randn(1, 700, 2, 128, device="cuda", dtype=torch.float16) for _ in range(2))
for splits in (6, 7, 40):  # sm_90: the cluster merge, then the combine kernel (> 6 splits)
    fa.flash_attn_func(q, k, v, causal=True, num_splits=splits)
    # The same on the 4-key-warp decode tile (tile=3): its warps merge in shared memory
    # first (64-key tiles: 700 keys give at most 11 splits).
    torch.ops.flash_attn_ext.fwd(q, k, v, 128 ** -0.5, True, True, min(splits, 11), 3)
# Auto on a decode grid that fills the GPU unsplit: the key-warp tile, D = 64 (128-key tiles).
q = torch.randn(4, 1, 64, 64, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(4, 333, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
fa.flash_attn_func(q, k, v)
# Variants (window, softcap, ALiBi): forward on the Hopper kernel (sm_90, D 64/128/256) or
# the mma.sync variant kernels, backward on the mma.sync ones, fp32 on the SIMT kernels;
# then a window alone (the Hopper forward's masked-tiles-only path) and a split-KV decode
# with a window.
for dtype, d in ((torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 64)):
    q, k, v = (torch.randn(2, s, 4, d, device="cuda", dtype=dtype, requires_grad=True)
               for s in (150, 210, 210))
    slopes = torch.rand(2, 4, device="cuda", dtype=torch.float32)
    out = fa.flash_attn_func(q, k, v, causal=True, window_size=(40, 0), softcap=30.0,
                             alibi_slopes=slopes)
    out.backward(torch.randn_like(out))
q, k, v = (torch.randn(1, s, 2, 256, device="cuda", dtype=torch.bfloat16) for s in (300, 333, 333))
fa.flash_attn_func(q, k, v, window_size=(100, 50))
q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(2, 700, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
fa.flash_attn_func(q, k, v, causal=True, window_size=(300, 0), softcap=20.0, num_splits=3)
# Variants on the Hopper backward (D 64/128/256: softcap at D = 256 hands P through the dS
# buffer; deterministic windows order the dQ adds by the window's key tiles), attn_mask
# (bool key padding and an additive mask whose tensor ends at the last row: no read past
# it), dropout (forward on the Hopper kernel, backward on mma.sync; fp32 on the SIMT
# kernels), varlen with dropout.
for d in (64, 128, 256):
    q, k, v = (torch.randn(2, s, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for s in (200, 333, 333))
    for kw in (dict(softcap=5.0), dict(window_size=(70, 30), deterministic=True),
               dict(causal=True, dropout_p=0.2)):
        out = fa.flash_attn_func(q, k, v, **kw)
        out.backward(torch.randn_like(out))
    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    # (and a bf16 mask with 16-byte aligned rows: the Hopper kernels stage it through shared
    # memory)
    for mask in (torch.rand(2, 1, 1, 333, device="cuda") > 0.3,
                 torch.randn(200, 333, device="cuda", dtype=torch.bfloat16),
                 torch.randn(1, 2, 200, 336, device="cuda", dtype=torch.bfloat16)[..., :333]):
        out = fa.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=True)
        out.backward(torch.randn_like(out))
q, k, v = (torch.randn(1, s, 2, 64, device="cuda", dtype=torch.float32, requires_grad=True)
           for s in (70, 90, 90))
out = fa.flash_attn_func(q, k, v, dropout_p=0.3)
out.backward(torch.randn_like(out))
lens = [5, 0, 70, 33]
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
q, k, v = (torch.randn(sum(lens), 2, 128, device="cuda", dtype=torch.float16, requires_grad=True)
           for _ in range(3))
out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), dropout_p=0.1)
out.backward(torch.randn_like(out))
# Varlen with a window, softcap and per-sequence ALiBi (on sm_90 the Hopper variant kernels).
q, k, v = (torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), window_size=(20, 3),
                                softcap=30.0, alibi_slopes=torch.rand(len(lens), 2, device="cuda"))
out.backward(torch.randn_like(out))
# The FP8 forward (Hopper only), padded and packed (varlen: per-sequence V^T, zero-length and
# longer-than-a-tile sequences), causal and not; the short padded calls at D = 128 transpose V
# in the kernel, one longer one (2200 query rows per kv head) reads the V^T pass.
if torch.cuda.get_device_capability() == (9, 0):
    one = torch.ones((), device="cuda")
    lens_q, lens_k = [5, 0, 200, 33], [9, 4, 150, 300]
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32,
                               device="cuda") for n in (lens_q, lens_k))
    for d in (128, 256):
        q8 = torch.randn(sum(lens_q), 4, d, device="cuda").to(torch.float8_e4m3fn)
        k8, v8 = (torch.randn(sum(lens_k), 2, d, device="cuda").to(torch.float8_e4m3fn)
                  for _ in range(2))
        for causal in (False, True):
            fa.flash_attn_func(q8[None, :200], k8[None, :150], v8[None, :150], causal=causal,
                               q_descale=one, k_descale=one, v_descale=one)
            fa.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k),
                                      causal=causal, q_descale=one, k_descale=one, v_descale=one)
    q8, k8, v8 = (torch.randn(1, n, h, 128, device="cuda").to(torch.float8_e4m3fn)
                  for n, h in ((1100, 4), (150, 2), (150, 2)))
    fa.flash_attn_func(q8, k8, v8, q_descale=one, k_descale=one, v_descale=one)
# v's own head dim: 192 / 128 (on sm_90 the Hopper forward of that pair; the backward padded to
# the D = 256 Hopper kernel), GQA, odd lengths, causal; MLA's 576 / 512 forward (its own
# kernel), v a view of k's latent cache and a separate v, a paged decode with split-KV.
q = torch.randn(1, 129, 4, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, 257, 2, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, 257, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
out = fa.flash_attn_func(q, k, v, causal=True)
out.backward(torch.randn_like(out))
kv = torch.randn(2, 300, 1, 576, device="cuda", dtype=torch.bfloat16)
q = torch.randn(2, 37, 4, 576, device="cuda", dtype=torch.bfloat16)
fa.flash_attn_func(q, kv, kv[..., :512], causal=True)
fa.flash_attn_func(q, kv, torch.randn(2, 300, 1, 512, device="cuda", dtype=torch.bfloat16))
pool = torch.randn(16, 64, 1, 576, device="cuda", dtype=torch.bfloat16)
table = torch.randperm(16, device="cuda", dtype=torch.int32).view(2, 8)
fa.flash_attn_with_kvcache(q[:, :1].repeat(1, 1, 4, 1), pool, pool[..., :512],
                           cache_seqlens=torch.tensor([300, 77], dtype=torch.int32, device="cuda"),
                           block_table=table)
torch.cuda.synchronize()
print("sanitize cases done")
