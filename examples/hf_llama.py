#!/usr/bin/env python3
"""flash_attn_ext inside a Hugging Face transformers model. For your own model, three lines
(plus copying flash_attn_ext_attention from this file):

    AttentionInterface.register("fae", flash_attn_ext_attention)
    AttentionMaskInterface.register("fae", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fae")

(imports: `from transformers import AttentionInterface, AttentionMaskInterface,
AutoModelForCausalLM` and `from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS`).
The second line makes transformers build masks the way it does for "sdpa": none when the
mask is purely causal (our kernels apply it), a real mask when there is padding, which this
function refuses rather than ignores. The name must not contain "flash": transformers takes
any attn_implementation with "flash" in it for a flash-attn kernel to import (and changes its
mask handling), hence "fae" rather than "flash_attn_ext".

What this script checks: a small randomly initialised Llama (2 layers, hidden 256, 4 query
heads, 2 key/value heads, so GQA) built once with attn_implementation="sdpa" and once with
"fae" from the same weights; logits, loss gradients of every parameter and greedy
generation (KV cache, one query row per step) are compared, and a padded batch must raise
NotImplementedError.

  python examples/hf_llama.py                  # CPU, fp32: agrees with sdpa to ~1e-6
  python examples/hf_llama.py --device cuda    # bf16: agrees within bf16 noise

transformers is optional for flash_attn_ext: `pip install transformers` to run this.
"""
import argparse
import copy
import sys

import torch

import flash_attn_ext


CALLS = [0]  # how often flash_attn_ext_attention ran: the check below makes sure it did


def flash_attn_ext_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             **kwargs):
    """transformers attention function: query [B, H, Sq, D], key/value [B, H_kv, Sk, D]
    -> (attn_output [B, Sq, H, D], None)."""
    CALLS[0] += 1
    if dropout:
        raise NotImplementedError("flash_attn_ext: attention dropout is not supported")
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise NotImplementedError("flash_attn_ext: softcap / sliding-window attention is not supported")
    sq, sk = query.shape[2], key.shape[2]
    causal = bool(getattr(module, "is_causal", True)) and sq > 1
    if attention_mask is not None:
        # transformers only materialises a mask when it cannot be expressed as is_causal
        # (padding, or a KV cache with several new queries). Accept the causal pattern aligned
        # to the end of the keys, which is what flash_attn_func's causal=True applies; refuse
        # the rest rather than silently ignore padding. This check syncs with the device.
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        allowed = allowed[..., -sq:, -sk:] if allowed.dim() == 4 else allowed
        i = torch.arange(sq, device=query.device).view(-1, 1)
        j = torch.arange(sk, device=query.device).view(1, -1)
        bottom_right = j <= i + (sk - sq)
        if torch.equal(allowed, bottom_right.expand_as(allowed)):
            causal = True
        elif bool(allowed.all()):
            causal = False
        else:
            raise NotImplementedError("flash_attn_ext: padding / arbitrary attention masks are not "
                                      "supported (only causal); use unpadded batches")
    elif causal and sk > sq:
        # A static cache's prefill: the keys past sq are empty slots; sdpa drops them as well.
        key, value = key[:, :, :sq], value[:, :, :sq]
    # flash_attn_func takes [B, S, H, D]: transposed views, no copies. GQA needs no repeat_kv:
    # query head h reads key/value head h // (H // H_kv), as transformers' repeat_kv does.
    # Causal is aligned to the end of the keys (bottom-right), right for decoding with a KV
    # cache.
    out = flash_attn_ext.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2),
                                         value.transpose(1, 2), softmax_scale=scaling, causal=causal)
    return out, None


NAME = "fae"  # the attn_implementation name; see the module docstring for why not "flash_..."


def register(name=NAME):
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    AttentionInterface.register(name, flash_attn_ext_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def max_abs_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def run_model(model, ids, labels):
    """Logits and the gradients of the loss with respect to every parameter."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def grad_err(g, ref):
    """Largest gradient difference over all parameters, relative to that parameter's gradient size."""
    return max(max_abs_diff(g[n], ref[n]) / (ref[n].float().abs().max().item() + 1e-12) for n in ref)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default fp32 on CPU, bf16 on GPU)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=128)
    args = p.parse_args(argv)
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError:
        print("this example needs transformers: pip install transformers", file=sys.stderr)
        return 2
    register()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.dtype or ("fp32" if args.device == "cpu" else "bf16")]

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    # from_config records the attention implementation in the config it is given: one copy each.
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=NAME)
    ours.load_state_dict(sdpa.state_dict())
    assert (sdpa.config._attn_implementation, ours.config._attn_implementation) == ("sdpa", NAME)
    print(f"Llama: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads; "
          f"{args.device}, {str(dtype).replace('torch.', '')}, batch {args.batch} x {args.seqlen} tokens")

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seqlen), generator=gen).to(args.device)

    # fp32 sdpa is the reference; in bf16/fp16 both implementations are judged by their
    # distance to it (ours within 2x sdpa's own error + a margin: FlashAttention's rule).
    ref = run_model(sdpa.to(args.device, torch.float32), ids, ids)
    models = {"sdpa": sdpa.to(args.device, dtype), "flash_attn_ext": ours.to(args.device, dtype)}
    res = {name: run_model(m, ids, ids) for name, m in models.items()}
    assert CALLS[0] == config.num_hidden_layers, f"flash_attn_ext_attention ran {CALLS[0]} times"

    logit_err = {n: max_abs_diff(r[0], ref[0]) for n, r in res.items()}
    loss_err = {n: abs(r[1].item() - ref[1].item()) for n, r in res.items()}
    g_err = {n: grad_err(r[2], ref[2]) for n, r in res.items()}
    print(f"loss: fp32 sdpa {ref[1].item():.6f}, flash_attn_ext {res['flash_attn_ext'][1].item():.6f}")
    direct = max_abs_diff(res["flash_attn_ext"][0], res["sdpa"][0])
    print(f"max |logits(flash_attn_ext) - logits(sdpa)|, same dtype: {direct:.3e}")
    for n in res:
        print(f"{n:>15} vs fp32 sdpa: logits max abs diff {logit_err[n]:.3e}, loss diff "
              f"{loss_err[n]:.3e}, max relative grad diff {g_err[n]:.3e}")

    if dtype == torch.float32:
        assert logit_err["flash_attn_ext"] < 1e-4, logit_err
        assert loss_err["flash_attn_ext"] < 1e-5, loss_err
        assert g_err["flash_attn_ext"] < 1e-3, g_err
    else:
        assert logit_err["flash_attn_ext"] <= 2 * logit_err["sdpa"] + 1e-2, logit_err
        assert loss_err["flash_attn_ext"] <= 2 * loss_err["sdpa"] + 1e-3, loss_err
        assert g_err["flash_attn_ext"] <= 2 * g_err["sdpa"] + 1e-2, g_err

    # Greedy decoding: prefill, then one query row per step against the KV cache.
    prompt = ids[:1, :16]
    with torch.no_grad():
        toks = {n: m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                              do_sample=False, pad_token_id=0) for n, m in models.items()}
    same = torch.equal(toks["sdpa"], toks["flash_attn_ext"])
    print(f"greedy generation, 12 new tokens: {'identical' if same else 'DIFFERENT'} "
          f"({toks['flash_attn_ext'][0, 16:].tolist()})")
    if dtype == torch.float32:
        assert same, toks

    # Several new queries against a KV cache: transformers passes an explicit causal mask
    # (aligned to the end of the keys), which the function recognises.
    with torch.no_grad():
        chunk = {}
        for n, m in models.items():
            past = m(input_ids=ids[:, :24], use_cache=True).past_key_values
            chunk[n] = m(input_ids=ids[:, 24:32], past_key_values=past, use_cache=True).logits
    chunk_err = max_abs_diff(chunk["flash_attn_ext"], chunk["sdpa"])
    print(f"8 new tokens on a 24-token KV cache: max |logits diff| vs sdpa {chunk_err:.3e}")
    assert chunk_err <= (1e-4 if dtype == torch.float32 else 4 * logit_err["sdpa"] + 5e-2), chunk_err

    # A padded batch needs a real mask: refused, not silently ignored.
    mask = torch.ones_like(ids)
    mask[0, :8] = 0
    try:
        with torch.no_grad():
            models["flash_attn_ext"](input_ids=ids, attention_mask=mask)
    except NotImplementedError as e:
        print(f"padded batch: NotImplementedError ({e})")
    else:
        raise AssertionError("a padding mask was accepted")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
