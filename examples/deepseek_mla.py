#!/usr/bin/env python3
"""DeepSeek's multi-head latent attention (MLA) through flash_attn_ext: the training form
(q / k head dim 192 = 128 "nope" + 64 rope columns, v head dim 128) and the absorbed decode
form (one 576-wide latent head: 512 latent + 64 rope columns, v = the cache's first 512
columns), which must give the same outputs.

  training   q_h = [q_nope_h, q_rope_h], k_h = [c_kv W_uk_h, k_rope], v_h = c_kv W_uv_h
             flash_attn_func(q, k, v, causal=True): head dims 192 / 128
  decoding   the cache keeps only [c_kv, k_rope] per token (576 values, shared by all heads);
             q_h is absorbed into the latent space, [q_nope_h W_uk_h^T, q_rope_h] (576), the
             output comes back through W_uv_h:
             flash_attn_with_kvcache(q_abs, kv_cache, kv_cache[..., :512], ...) -> o_latent,
             o_h = o_latent_h W_uv_h; softmax_scale stays 1/sqrt(192)

What this script checks (random weights, no download; rope left out: it rotates q_rope and
k_rope alike in both forms): (1) the training form's output and gradients against PyTorch's
own attention (torch.nn.functional.scaled_dot_product_attention, which takes a v head dim
of its own too), (2) the absorbed decode of the last token, from a contiguous and from a paged
latent cache, against the training form's output at that position.

  python examples/deepseek_mla.py                # CPU, fp32
  python examples/deepseek_mla.py --device cuda  # bf16 (the 192 / 128 Hopper forward, the
                                                 # 576 / 512 decode kernel)
"""
import argparse
import math

import torch
import torch.nn.functional as F

import flash_attn_ext as fa

D_LATENT, D_ROPE, D_NOPE, D_V = 512, 64, 128, 128


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=100)
    p.add_argument("--heads", type=int, default=8)
    args = p.parse_args(argv)
    dev = args.device
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    B, S, H = args.batch, args.seqlen, args.heads
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    # What a layer's projections produce per token: the latent c_kv and the shared k_rope,
    # per head q_nope / q_rope, and the up-projections W_uk, W_uv of the latent.
    c_kv = rand(B, S, D_LATENT)
    k_rope = rand(B, S, D_ROPE)
    q_nope = rand(B, S, H, D_NOPE)
    q_rope = rand(B, S, H, D_ROPE)
    w_uk = rand(H, D_LATENT, D_NOPE, scale=D_LATENT ** -0.5)
    w_uv = rand(H, D_LATENT, D_V, scale=D_LATENT ** -0.5)
    scale = 1.0 / math.sqrt(D_NOPE + D_ROPE)

    # (1) training form: 192 / 128, fwd + bwd, against torch's attention.
    k_nope = torch.einsum("bsc,hcd->bshd", c_kv, w_uk)
    q = torch.cat([q_nope, q_rope], -1).requires_grad_()
    k = torch.cat([k_nope, k_rope[:, :, None].expand(B, S, H, D_ROPE)], -1).requires_grad_()
    v = torch.einsum("bsc,hcd->bshd", c_kv, w_uv).requires_grad_()
    out = fa.flash_attn_func(q, k, v, causal=True, softmax_scale=scale)
    dout = rand(*out.shape)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, scale=scale)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double().transpose(1, 2))
    ref = ref.transpose(1, 2)
    out_err = (out.double() - ref).abs().max().item()
    grad_err = max((g.double() - r.transpose(1, 2)).abs().max().item()
                   for g, r in zip(grads, ref_grads))
    print(f"training form (q / k 192, v 128), out {tuple(out.shape)}: max |out diff| vs torch "
          f"fp64 {out_err:.2e}, max |grad diff| {grad_err:.2e}")

    # (2) absorbed decode of the last token: one latent head [c_kv, k_rope] (576), v its
    # first 512 columns; q absorbed through W_uk, the output back through W_uv.
    kv_cache = torch.cat([c_kv, k_rope], -1)[:, :, None]  # [B, S, 1, 576]
    q_last = torch.cat([torch.einsum("bhd,hcd->bhc", q_nope[:, -1], w_uk), q_rope[:, -1]], -1)
    q_abs = q_last[:, None]  # [B, 1, H, 576]
    lengths = torch.full((B,), S, dtype=torch.int32, device=dev)
    page = 16
    pages = -(-S // page)
    pool = torch.zeros(B * pages, page, 1, D_LATENT + D_ROPE, dtype=dtype, device=dev)
    order = torch.randperm(B * pages, generator=gen).to(dev)
    padded = torch.zeros(B, pages * page, 1, D_LATENT + D_ROPE, dtype=dtype, device=dev)
    padded[:, :S] = kv_cache
    pool[order] = padded.reshape(B * pages, page, 1, -1)
    table = order.view(B, pages).to(torch.int32)
    errs = []
    for name, cache, block_table in (("contiguous", kv_cache, None), ("paged", pool, table)):
        o_latent = fa.flash_attn_with_kvcache(q_abs, cache, cache[..., :D_LATENT],
                                              cache_seqlens=lengths, block_table=block_table,
                                              softmax_scale=scale, causal=True)
        o_dec = torch.einsum("bhc,hcd->bhd", o_latent[:, 0].float(), w_uv.float())
        err = (o_dec.double() - ref[:, -1]).abs().max().item()
        errs.append(err)
        print(f"absorbed decode ({name} latent cache, q / k 576, v 512 a view of k): max |out "
              f"diff| vs the training form's last token {err:.2e}")
    # fp32: rounding only; 16-bit: q, k, v and the absorbed q in bf16, at most ~5% of |out|.
    tol = (1e-4 if dtype == torch.float32 else 5e-2) * max(1.0, ref.abs().max().item())
    ok = out_err < tol and grad_err < 10 * tol and max(errs) < tol
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
