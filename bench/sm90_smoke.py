"""Quick check of the Hopper forward and backward on a few shapes (prints max errors
vs fp32 SDPA math and vs the mma.sync path); used before the full GPU tests because a
pipeline deadlock would otherwise hang the test run."""
import os
import sys

import torch
import torch.nn.functional as F

import flash_attn_ext as fa


def run(q, k, v, dout, causal, impl):
    """(out, dq, dk, dv) with both passes on `impl` (auto = Hopper where it applies)."""
    os.environ["FLASH_ATTN_EXT_FWD_IMPL"] = os.environ["FLASH_ATTN_EXT_BWD_IMPL"] = impl
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fa.flash_attn_func(*leaves, causal=causal, num_splits=1)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    return (out, *grads)


def reference(q, k, v, dout, causal):
    leaves = [t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    grads = torch.autograd.grad(out, leaves, dout.float().transpose(1, 2))
    return [t.transpose(1, 2) for t in (out, *grads)]


def main():
    torch.manual_seed(0)
    failed = 0
    for D in (64, 128, 256):
        for causal in (False, True):
            for S in (128, 1000):
                q, k, v, dout = (torch.randn(2, S, 4, D, device="cuda", dtype=torch.bfloat16)
                                 for _ in range(4))
                ours = run(q, k, v, dout, causal, "auto")
                mma = run(q, k, v, dout, causal, "mma")
                ref = reference(q, k, v, dout, causal)
                line = []
                for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, mma, ref):
                    err = (a.float() - r).abs().max().item()
                    err_mma = (b.float() - r).abs().max().item()
                    ok = err <= 2 * err_mma + 1e-3
                    failed += not ok
                    line.append(f"{name} {err:.2e}/{err_mma:.2e}{'' if ok else ' FAIL'}")
                print(f"D={D:3d} causal={int(causal)} S={S:5d}  (ours/mma err) " + "  ".join(line),
                      flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
