"""Quick check of the Hopper forward on a few shapes (prints max errors vs fp32
SDPA math and vs the mma.sync path); used before the full GPU tests because a
pipeline deadlock would otherwise hang the test run."""
import os
import sys

import torch
import torch.nn.functional as F

import flash_attn_ext as fa


def main():
    torch.manual_seed(0)
    failed = 0
    for D in (64, 128, 256):
        for causal in (False, True):
            for S in (128, 1000):
                q, k, v = (torch.randn(2, S, 4, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                os.environ["FLASH_ATTN_EXT_FWD_IMPL"] = "auto"
                out = fa.flash_attn_func(q, k, v, causal=causal, num_splits=1)
                torch.cuda.synchronize()
                os.environ["FLASH_ATTN_EXT_FWD_IMPL"] = "mma"
                out_mma = fa.flash_attn_func(q, k, v, causal=causal, num_splits=1)
                ref = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)),
                                                     is_causal=causal).transpose(1, 2)
                err = (out.float() - ref).abs().max().item()
                err_mma = (out_mma.float() - ref).abs().max().item()
                ok = err <= 2 * err_mma + 1e-3
                failed += not ok
                print(f"D={D:3d} causal={int(causal)} S={S:5d}  err {err:.3e}  mma err {err_mma:.3e}"
                      f"  {'ok' if ok else 'FAIL'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
