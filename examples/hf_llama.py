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
function hands to flash_attn_ext's scaled_dot_product_attention (bool or additive masks are
read tile by tile); sliding windows, softcap and dropout go to flash_attn_func. The name must not contain "flash": transformers takes
any attn_implementation with "flash" in it for a flash-attn kernel to import (and changes its
mask handling), hence "fae" rather than "flash_attn_ext".

What this script checks: a small randomly initialised Llama (2 layers, hidden 256, 4 query
heads, 2 key/value heads, so GQA) built once with attn_implementation="sdpa" and once with
"fae" from the same weights; logits, loss gradients of every parameter and greedy
generation (KV cache, one query row per step; also a left-padded batch with transformers'
static cache) are compared, and so are the logits of a left-padded batch (an explicit
padding mask).

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


def _window(sliding_window):
    """transformers' sliding_window (a query sees the last `sliding_window` keys, itself
    included) as flash-attn's window_size."""
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


def _mask_is_pattern(attention_mask, sq, sk, window, device):
    """Whether the mask allows exactly the bottom-right causal pattern (within `window`), the
    one flash_attn_func applies with causal=True. Syncs with the device."""
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    allowed = allowed[..., -sq:, -sk:]
    i = torch.arange(sq, device=device).view(-1, 1) + (sk - sq)
    j = torch.arange(sk, device=device).view(1, -1)
    pattern = (j <= i) & ((j > i - window[0] - 1) if window[0] >= 0 else True)
    return torch.equal(allowed, pattern.expand_as(allowed))


def flash_attn_ext_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             softcap=None, sliding_window=None, s_aux=None, **kwargs):
    """transformers attention function: query [B, H, Sq, D], key/value [B, H_kv, Sk, D]
    -> (attn_output [B, Sq, H, D], None). s_aux: gpt-oss's learnable sinks ([H], one logit per
    query head; examples/hf_gpt_oss.py), passed on as learnable_sink."""
    CALLS[0] += 1
    sq, sk = query.shape[2], key.shape[2]
    window = _window(sliding_window)
    if attention_mask is not None and (softcap or sliding_window is not None) and \
            _mask_is_pattern(attention_mask, sq, sk, window, query.device):
        # causal (+ window), no padding: flash_attn_func applies it itself (with the softcap,
        # and the window without reading a mask)
        attention_mask = None
    if attention_mask is not None:
        # transformers materialises a mask where is_causal cannot express it (padding, several
        # new queries against a KV cache, sliding windows): the SDPA entry point reads it as it
        # is (bool or additive, [B, 1, Sq, Sk]), tile by tile, with GQA and dropout.
        if softcap:
            raise NotImplementedError("flash_attn_ext: softcap together with a padding mask")
        out = flash_attn_ext.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask[..., :sk], dropout_p=dropout,
            scale=scaling, enable_gqa=True, learnable_sink=s_aux)
        return out.transpose(1, 2), None
    causal = bool(getattr(module, "is_causal", True))
    if causal and sk > sq and sq > 1:
        # A static cache's prefill: the keys past sq are empty slots; sdpa drops them as well.
        key, value = key[:, :, :sq], value[:, :, :sq]
    # flash_attn_func takes [B, S, H, D]: transposed views, no copies. GQA needs no repeat_kv:
    # query head h reads key/value head h // (H // H_kv), as transformers' repeat_kv does.
    # Causal and the window are aligned to the end of the keys (bottom-right), right for
    # decoding with a KV cache.
    out = flash_attn_ext.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2),
                                         value.transpose(1, 2), dropout_p=dropout,
                                         softmax_scale=scaling, causal=causal, window_size=window,
                                         softcap=softcap or 0.0, learnable_sink=s_aux)
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

    # Greedy decoding of a left-padded batch with transformers' static cache (preallocated
    # [B, H_kv, max_len, D] buffers: every step attends over the whole buffer under a mask
    # that hides the padding and the empty slots).
    prompt = ids[:, :16]
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[1, :5] = 0
    with torch.no_grad():
        toks = {n: m.generate(prompt, attention_mask=prompt_mask, max_new_tokens=12,
                              do_sample=False, pad_token_id=0, cache_implementation="static")
                for n, m in models.items()}
    same = torch.equal(toks["sdpa"], toks["flash_attn_ext"])
    print(f"greedy generation, static cache, left-padded batch: "
          f"{'identical' if same else 'DIFFERENT'}")
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

    # A padded batch: transformers passes the padding (and causal) mask, which the SDPA entry
    # point applies; the logits of the real tokens match sdpa's.
    mask = torch.ones_like(ids)
    mask[0, :8] = 0
    with torch.no_grad():
        padded = {n: m(input_ids=ids, attention_mask=mask).logits for n, m in models.items()}
    real = mask.bool()
    pad_err = max_abs_diff(padded["flash_attn_ext"][real], padded["sdpa"][real])
    print(f"padded batch (8 left-padding tokens): max |logits diff| vs sdpa on real tokens "
          f"{pad_err:.3e}")
    assert pad_err <= (1e-4 if dtype == torch.float32 else 4 * logit_err["sdpa"] + 5e-2), pad_err
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
