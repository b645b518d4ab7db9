"""The parts of flash_attn_with_kvcache (interface.py) that run before the attention kernel:
checking the cache arguments, rotary embeddings of q and the new k, and the in-place append
(quantised to e4m3 for an FP8 cache).

All of it is torch operations on the inputs' device with no host synchronisation (no .item(),
no tensor-valued Python conditions), so a decode step can be captured in a CUDA graph. What
cannot be checked without reading device values (cache_seqlens in range, block_table and
cache_batch_idx entries in range) is checked only when FLASH_ATTN_EXT_DEBUG_CHECKS=1; without
it such values are clamped into the cache (wrong rows, never an out-of-bounds access).
"""
import os

import torch

# An FP8 KV cache: e4m3 values, real = descale * stored; appends saturate to +-E4M3_MAX.
from .fp8 import E4M3_MAX, FP8_DTYPE

# Pages of a paged KV cache hold a multiple of this many keys (csrc/params.h,
# kKVPageRowAlign: the CUDA tile loaders look a page up once per 16 rows).
PAGE_ROW_ALIGN = 16



_DEBUG_ENV = "FLASH_ATTN_EXT_DEBUG_CHECKS"
# CPython's os.environ keeps its entries in the dict _data under encodekey(name): looking the
# name up there first costs a dict lookup per decode call, where os.environ.get encodes the
# name and raises a KeyError inside when it is unset (~0.7 us). Elsewhere: os.environ.get.
_ENV_DATA = getattr(os.environ, "_data", None)
_DEBUG_ENV_KEY = os.environ.encodekey(_DEBUG_ENV) if hasattr(os.environ, "encodekey") else None


def debug_checks_enabled() -> bool:
    """FLASH_ATTN_EXT_DEBUG_CHECKS=1: validate device-side values on the host (one sync).
    Read at every call, so it can be switched on for a few calls."""
    if isinstance(_ENV_DATA, dict) and _DEBUG_ENV_KEY not in _ENV_DATA:
        return False
    return os.environ.get(_DEBUG_ENV, "") not in ("", "0")


def _check_int32_tensor(t, name, shape, shape_text, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flash_attn_ext: {name} must be None or an int32 tensor {shape_text}, "
                        f"got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise RuntimeError(f"flash_attn_ext: {name} must be int32, got {t.dtype}")
    if t.device != device:
        raise RuntimeError(f"flash_attn_ext: {name} must be on the device of q ({device}), got "
                           f"{t.device}")
    if t.dim() != len(shape) or any(s is not None and t.shape[i] != s
                                    for i, s in enumerate(shape)):
        raise RuntimeError(f"flash_attn_ext: {name} must have shape {shape_text}, got "
                           f"{tuple(t.shape)}")


class CacheLayout:
    """Validated addressing of a KV cache: dense [batch_c, cache_size, heads_k, head_dim]
    (optionally rows picked by cache_batch_idx, keys starting at cache_leftpad) or paged
    (pools [num_pages, page_size, heads_k, head_dim] and block_table [batch, max_pages]).
    capacity: the keys one batch entry can address."""

    __slots__ = ("block_table", "cache_batch_idx", "cache_leftpad", "capacity", "num_pages",
                 "page_size")

    def __init__(self, q, k_cache, block_table, cache_batch_idx, cache_leftpad):
        self.block_table, self.cache_batch_idx = block_table, cache_batch_idx
        self.cache_leftpad = cache_leftpad
        batch = q.shape[0]
        if block_table is None and cache_batch_idx is None and cache_leftpad is None:
            # A dense cache with one row per batch entry (the common decode call).
            if k_cache.shape[0] != batch:
                raise RuntimeError(
                    f"flash_attn_ext: k_cache has {k_cache.shape[0]} batch entries but q has "
                    f"{batch} (pass cache_batch_idx to pick cache rows)")
            self.capacity = k_cache.shape[1]
            return
        device = q.device
        if block_table is not None:
            if cache_batch_idx is not None:
                raise RuntimeError(
                    "flash_attn_ext: cache_batch_idx cannot be combined with block_table (a paged "
                    "KV cache selects each sequence's pages through its block_table row)")
            if cache_leftpad is not None:
                raise NotImplementedError(
                    "flash_attn_ext: cache_leftpad with a paged KV cache (block_table) is not "
                    "implemented")
            _check_int32_tensor(block_table, "block_table", (batch, None),
                                f"[batch, max_pages] = [{batch}, max_pages]", device)
            if block_table.shape[1] < 1:
                raise RuntimeError("flash_attn_ext: block_table needs at least one page per "
                                   "sequence (max_pages >= 1)")
            self.num_pages, self.page_size = k_cache.shape[0], k_cache.shape[1]
            if self.page_size % PAGE_ROW_ALIGN != 0:
                raise RuntimeError(
                    "flash_attn_ext: a paged KV cache needs a page size (k_cache.shape[1]) that "
                    f"is a multiple of {PAGE_ROW_ALIGN}, got {self.page_size}")
            self.capacity = block_table.shape[1] * self.page_size
        else:
            if cache_batch_idx is not None:
                _check_int32_tensor(cache_batch_idx, "cache_batch_idx", (batch,), f"[{batch}]",
                                    device)
            elif k_cache.shape[0] != batch:
                raise RuntimeError(
                    f"flash_attn_ext: k_cache has {k_cache.shape[0]} batch entries but q has "
                    f"{batch} (pass cache_batch_idx to pick cache rows)")
            self.capacity = k_cache.shape[1]
        if cache_leftpad is not None:
            _check_int32_tensor(cache_leftpad, "cache_leftpad", (batch,), f"[{batch}]", device)

    def cache_indices(self, k_cache, lengths, seqlen_new):
        """Index tuple of the cache rows the new keys go to: position cache_seqlens[b] + t of
        batch entry b (through block_table / cache_batch_idx), positions clamped into the
        cache so that an unchecked out-of-range append cannot write out of bounds."""
        device = lengths.device
        pos = lengths.long().unsqueeze(1) + torch.arange(seqlen_new, device=device)
        pos = pos.clamp(0, self.capacity - 1)
        if self.block_table is not None:
            page = torch.div(pos, self.page_size, rounding_mode="floor")
            page = self.block_table.long().gather(1, page).clamp(0, self.num_pages - 1)
            return page, pos % self.page_size
        if self.cache_batch_idx is not None:
            rows = self.cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1)
        else:
            rows = torch.arange(lengths.shape[0], device=device)
        return rows.unsqueeze(1), pos

    def debug_check(self, k_cache, lengths, seqlen_new):
        """The device values checked on the host (FLASH_ATTN_EXT_DEBUG_CHECKS=1)."""
        lens = lengths.cpu()
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0 or hi + seqlen_new > self.capacity:
            raise RuntimeError(
                f"flash_attn_ext: the KV cache is too short: appending {seqlen_new} tokens at "
                f"cache_seqlens up to {hi} needs {hi + seqlen_new} entries, the cache has "
                f"{self.capacity} (and cache_seqlens must be >= 0, got min {lo})")
        if self.cache_leftpad is not None:
            pad = self.cache_leftpad.cpu()
            if bool((pad < 0).any()) or bool((pad > lens).any()):
                raise RuntimeError("flash_attn_ext: cache_leftpad must be in [0, cache_seqlens], "
                                   f"got {pad.tolist()} for cache_seqlens {lens.tolist()}")
        if self.cache_batch_idx is not None:
            idx = self.cache_batch_idx.cpu()
            if bool((idx < 0).any()) or bool((idx >= k_cache.shape[0]).any()):
                raise RuntimeError(f"flash_attn_ext: cache_batch_idx entries must be in [0, "
                                   f"{k_cache.shape[0]}), got {idx.tolist()}")
        if self.block_table is not None:
            table = self.block_table.cpu()
            for b, n in enumerate((lens + seqlen_new).tolist()):
                used = table[b, :(n + self.page_size - 1) // self.page_size]
                if bool((used < 0).any()) or bool((used >= self.num_pages).any()):
                    raise RuntimeError(
                        f"flash_attn_ext: block_table[{b}] has page ids outside [0, "
                        f"{self.num_pages}) among the {used.numel()} pages its {n} keys use: "
                        f"{used.tolist()}")


def paged_key_rows(block_table, num_pages, page_size, max_seqlen_k):
    """Where keys 0 .. max_seqlen_k - 1 of each sequence of a paged cache live: (page, slot),
    int64 [batch, max_seqlen_k] each; key r of sequence b is slot r % page_size of page
    block_table[b, r // page_size], the page id clamped into [0, num_pages) as the kernels clamp
    it (csrc/params.h, kv_row). Needs max_seqlen_k <= max_pages * page_size (the operators check
    it). Device operations only (no host synchronisation)."""
    rows = torch.arange(max_seqlen_k, device=block_table.device)
    pages = block_table.long()[:, rows // page_size].clamp(0, num_pages - 1)
    return pages, (rows % page_size).expand_as(pages)


def check_rotary(rotary_cos, rotary_sin, q, k, capacity):
    """Validates flash-attn's rotary_cos / rotary_sin ([seqlen_ro, rotary_dim / 2]); returns
    rotary_dim (0: no rotary embedding)."""
    if rotary_cos is None and rotary_sin is None:
        return 0
    if rotary_cos is None or rotary_sin is None:
        raise RuntimeError("flash_attn_ext: pass both rotary_cos and rotary_sin, or neither")
    for t, name in ((rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attn_ext: {name} must be a tensor [seqlen_ro, rotary_dim / 2], "
                            f"got {type(t).__name__}")
        if not t.is_floating_point():
            raise RuntimeError(f"flash_attn_ext: {name} must be a floating-point tensor, got "
                               f"{t.dtype}")
        if t.device != q.device:
            raise RuntimeError(f"flash_attn_ext: {name} must be on the device of q ({q.device}), "
                               f"got {t.device}")
        if t.dim() != 2:
            raise RuntimeError(f"flash_attn_ext: {name} must be 2-D [seqlen_ro, rotary_dim / 2], "
                               f"got shape {tuple(t.shape)}")
    if rotary_cos.shape != rotary_sin.shape:
        raise RuntimeError("flash_attn_ext: rotary_cos and rotary_sin must have the same shape, "
                           f"got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
    if k is None:
        raise RuntimeError("flash_attn_ext: rotary embeddings (rotary_cos / rotary_sin) need the "
                           "new k and v to append (as in flash-attn): q and the new keys are "
                           "rotated at their cache positions")
    rotary_dim = 2 * rotary_cos.shape[1]
    head_dim = q.shape[-1]
    if rotary_dim > head_dim or rotary_dim % 16 != 0:
        raise RuntimeError(
            "flash_attn_ext: rotary_dim (2 * rotary_cos.shape[1] = "
            f"{rotary_dim}) must be a multiple of 16 and at most head_dim ({head_dim})")
    if rotary_cos.shape[0] < capacity:
        raise RuntimeError(
            f"flash_attn_ext: rotary_cos / rotary_sin have {rotary_cos.shape[0]} positions, fewer "
            f"than the KV cache holds ({capacity})")
    return rotary_dim


def apply_rotary(x, cos, sin, positions, interleaved):
    """Rotary embedding of x [batch, seqlen, heads, head_dim] at `positions` (int64 [batch,
    seqlen], or [batch, 1] for one position per batch entry), flash-attn's convention: the first
    rotary_dim = 2 * cos.shape[1] dims rotate in pairs (interleaved: (0, 1), (2, 3), ...; else
    (i, i + rotary_dim / 2)), x0' = x0 cos - x1 sin, x1' = x0 sin + x1 cos, in fp32, the rest
    passes through. Positions are clamped into the table."""
    half = cos.shape[1]
    rotary_dim = 2 * half
    positions = positions.clamp(0, cos.shape[0] - 1)
    c = cos[positions].float().unsqueeze(2)  # [batch, seqlen | 1, 1, half]
    s = sin[positions].float().unsqueeze(2)
    xr = x[..., :rotary_dim].float()
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    if rotary_dim == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def rotary_per_token(causal, window_size, capacity):
    """flash-attn rotates the queries at cache_seqlens + t (token t) when the call is causal or
    local (a window bound that the cache does not make moot), else all at cache_seqlens."""
    left, right = window_size
    return bool(causal) or 0 <= left < capacity or 0 <= right < capacity


# ---- head dims ---------------------------------------------------------------------------
CUDA_MAX_HEAD_DIM = 256
MLA_HEAD_DIMS = (576, 512)  # DeepSeek MLA's absorbed decode: a CUDA forward of its own


def check_cuda_head_dims(q, v_cache, fp8, has_variants):
    """The head dims the CUDA forward takes (ops_cuda.cpp: up to 256 each, or MLA's 576 / 512
    in 16 bits without window / softcap / ALiBi), checked before anything is appended so that
    a call the operator would refuse leaves the cache as it was."""
    if not q.is_cuda:
        return
    dims = (q.shape[-1], v_cache.shape[-1])
    if max(dims) <= CUDA_MAX_HEAD_DIM:
        return
    if dims != MLA_HEAD_DIMS:
        raise NotImplementedError(
            f"flash_attn_ext: the CUDA forward takes head dims up to {CUDA_MAX_HEAD_DIM} and "
            f"DeepSeek MLA's 576 / 512, got {dims[0]} (q / k) and {dims[1]} (v)")
    if has_variants or fp8 or q.dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(
            "flash_attn_ext: the CUDA forward of head dims 576 / 512 (MLA) takes float16 or "
            "bfloat16 q, k and v without window_size, softcap or alibi_slopes (no FP8 KV cache)")


# ---- FP8 (e4m3) KV cache ------------------------------------------------------------------
def check_fp8_cache(q, k_cache, v_cache, k_descale, v_descale):
    """Validates an FP8 cache's k_descale / v_descale (float32 on q's device, [] / [1] or
    [batch, heads_k]) before anything is appended; returns whether the cache is FP8. Descales
    with a 16-bit cache are an error, and so is an FP8 cache without them."""
    fp8 = k_cache.dtype is FP8_DTYPE or v_cache.dtype is FP8_DTYPE
    if not fp8:
        if k_descale is not None or v_descale is not None:
            raise ValueError(
                "flash_attn_ext: k_descale / v_descale are the dequantisation factors of an FP8 "
                f"(torch.float8_e4m3fn) KV cache, but k_cache has dtype {k_cache.dtype}")
        return False
    if k_cache.dtype is not v_cache.dtype:
        raise RuntimeError("flash_attn_ext: k_cache and v_cache must have the same dtype, got "
                           f"{k_cache.dtype} and {v_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(
            "flash_attn_ext: an FP8 KV cache needs q in float16 or bfloat16 (float32 q is not "
            f"implemented), got {q.dtype}")
    batch, heads_k = q.shape[0], k_cache.shape[2]
    missing = [n for n, d in (("k_descale", k_descale), ("v_descale", v_descale)) if d is None]
    if missing:
        raise ValueError(
            "flash_attn_ext: an FP8 (torch.float8_e4m3fn) KV cache needs k_descale and "
            f"v_descale (float32, shape [], [1] or [batch, heads_k] = [{batch}, {heads_k}]); "
            f"missing {', '.join(missing)}. Pass torch.ones((), device=q.device) for a cache "
            "stored unscaled.")
    for d, name in ((k_descale, "k_descale"), (v_descale, "v_descale")):
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"flash_attn_ext: {name} must be a float32 tensor, got "
                            f"{type(d).__name__}")
        if d.dtype != torch.float32:
            raise RuntimeError(f"flash_attn_ext: {name} must be float32, got {d.dtype}")
        if d.device != q.device:
            raise RuntimeError(f"flash_attn_ext: {name} must be on the device of q ({q.device}), "
                               f"got {d.device}")
        if not (d.numel() == 1 and d.dim() <= 2) and tuple(d.shape) != (batch, heads_k):
            raise RuntimeError(f"flash_attn_ext: {name} must have shape [], [1] or [batch, "
                               f"heads_k] = [{batch}, {heads_k}], got {tuple(d.shape)}")
    return True


def quantize_for_cache(x, descale):
    """New keys or values x [batch, seqlen_new, heads_k, head_dim] as an FP8 cache stores them:
    e4m3 x as given, else round(x / descale) saturated to +-448 (descale [] / [1] or [batch,
    heads_k], batch entry b's factor for its rows; None: x is in the cache's units already)."""
    if x.dtype is FP8_DTYPE:
        return x
    xf = x.float()
    if descale is not None:
        d = descale.reshape(()) if descale.numel() == 1 else descale[:, None, :, None]
        xf = xf / d
    return xf.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def store_rows(cache, rows, x):
    """cache[rows] = x (converted to the cache's dtype); FP8 caches through byte views (the
    same bits, an index_put that every device implements)."""
    if cache.dtype is FP8_DTYPE:
        cache.view(torch.uint8)[rows] = x.view(torch.uint8)
    else:
        cache[rows] = x.to(cache.dtype)
