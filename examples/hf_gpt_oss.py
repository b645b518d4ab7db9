#!/usr/bin/env python3
"""gpt-oss's attention (learnable sinks, alternating 128-token sliding-window and full layers)
through flash_attn_ext, trained with autograd: the sinks' gradient included.

transformers' gpt-oss attention passes its per-head sinks to the attention function as
`s_aux`; examples/hf_llama.py's flash_attn_ext_attention hands them to flash_attn_func as
`learnable_sink=`, and the sliding window as `window_size`, so both run in our kernels (no
[seqlen, seqlen] mask, no eager softmax). Registered under the name "fae" exactly as there:

    AttentionInterface.register("fae", flash_attn_ext_attention)
    AttentionMaskInterface.register("fae", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model = AutoModelForCausalLM.from_pretrained("openai/gpt-oss-20b", attn_implementation="fae")

What this script checks, without downloading anything: a small randomly initialised gpt-oss
(2 layers, one sliding-window and one full, 8 query heads over 2 key/value heads, head dim 64
as gpt-oss, a few experts), built once with attn_implementation="eager" (transformers' own
sink attention) and once with "fae" from the same weights, random sinks; the loss and the
gradients of every parameter, the sinks' included, are compared.

  python examples/hf_gpt_oss.py                 # CPU, fp32: agrees with eager to ~1e-6
  python examples/hf_gpt_oss.py --device cuda   # bf16: within bf16 noise of fp32 eager

transformers is optional for flash_attn_ext: `pip install transformers` to run this.
"""
import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_llama import CALLS, NAME, grad_err, max_abs_diff, register, run_model  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default fp32 on CPU, "
                   "bf16 on GPU)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=200)
    p.add_argument("--window", type=int, default=128, help="the sliding window (gpt-oss: 128)")
    args = p.parse_args(argv)
    try:
        from transformers import AutoModelForCausalLM, GptOssConfig
    except ImportError:
        print("this example needs transformers with gpt-oss: pip install transformers",
              file=sys.stderr)
        return 2
    register()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.dtype or ("fp32" if args.device == "cpu" else "bf16")]

    config = GptOssConfig(vocab_size=512, hidden_size=256, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=args.window,
                          layer_types=["sliding_attention", "full_attention"],
                          max_position_embeddings=4096)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    with torch.no_grad():  # random sinks (from_config leaves them as allocated)
        for layer in eager.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(config.num_attention_heads))
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=NAME)
    ours.load_state_dict(eager.state_dict())
    print(f"gpt-oss: {config.num_hidden_layers} layers ({', '.join(config.layer_types)}, window "
          f"{config.sliding_window}), {config.num_attention_heads} heads / "
          f"{config.num_key_value_heads} kv heads, head dim {config.head_dim}; {args.device}, "
          f"{str(dtype).replace('torch.', '')}, batch {args.batch} x {args.seqlen} tokens")

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seqlen), generator=gen)
    ids = ids.to(args.device)
    # fp32 eager is the reference; in bf16 / fp16 both are judged by their distance to it.
    ref = run_model(eager.to(args.device, torch.float32), ids, ids)
    models = {"eager": eager.to(args.device, dtype), "flash_attn_ext": ours.to(args.device, dtype)}
    res = {name: run_model(m, ids, ids) for name, m in models.items()}
    assert CALLS[0] == config.num_hidden_layers, f"flash_attn_ext_attention ran {CALLS[0]} times"

    loss_err = {n: abs(r[1].item() - ref[1].item()) for n, r in res.items()}
    g_err = {n: grad_err(r[2], ref[2]) for n, r in res.items()}
    sink_names = [n for n in ref[2] if n.endswith("sinks")]
    sink_err = {n: max(max_abs_diff(r[2][s], ref[2][s]) for s in sink_names)
                for n, r in res.items()}
    print(f"loss: fp32 eager {ref[1].item():.6f}, flash_attn_ext {res['flash_attn_ext'][1].item():.6f}")
    for n in res:
        print(f"{n:>15} vs fp32 eager: loss diff {loss_err[n]:.3e}, max relative grad diff "
              f"{g_err[n]:.3e}, max |d sinks diff| {sink_err[n]:.3e}")
    if dtype == torch.float32:
        assert loss_err["flash_attn_ext"] < 1e-5, loss_err
        assert g_err["flash_attn_ext"] < 1e-3, g_err
        assert sink_err["flash_attn_ext"] < 1e-5, sink_err
    else:
        assert loss_err["flash_attn_ext"] <= 2 * loss_err["eager"] + 1e-3, loss_err
        assert g_err["flash_attn_ext"] <= 2 * g_err["eager"] + 1e-2, g_err
        assert sink_err["flash_attn_ext"] <= 2 * sink_err["eager"] + 1e-3, sink_err
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
