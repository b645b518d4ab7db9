"""Optional forward autotuning: time the compiled kernel variants on the real inputs and
remember the fastest per (GPU arch, dtype, head dim, causal, shape bucket).

Off by default: the built-in heuristics (tile table + FA2's split-KV rule) are what the
README's speed tables measure. Turn it on with

    FLASH_ATTN_EXT_AUTOTUNE=1 python train.py            # whole process
    flash_attn_ext.autotune.enable()                     # from code
    with flash_attn_ext.autotune.enabled(): ...          # a block

The first forward call of a new key times every candidate (a few ms to a few hundred ms,
once); later calls look the winner up. Set FLASH_ATTN_EXT_AUTOTUNE_CACHE=/path.json to
keep winners across processes.

Candidates: the built-in choice (tile=0, which on sm_90 is the Hopper wgmma kernel wherever
it applies, with the heuristic split count and forced unsplit) and the three tile families
of the mma.sync kernel (tile=1: the large per-head-dim tiles of
csrc/cuda/fwd_kernel_traits.cuh, tile=2: the 16-row one-warp tile used for decoding, tile=3:
the 16-row tile whose 4 warps split each key tile) times a few split-KV counts (0 =
heuristic, 1 = off, forced 2..16). fp32, CPU and
torch.compile tracing keep the defaults (one kernel, or nothing can be timed).
The cache key includes a shape bucket (powers of two of seqlen_q, seqlen_k and
batch*heads) next to (arch, dtype, head dim, causal), since the best split count depends
on how full the grid is.
"""
import contextlib
import json
import os
import threading

import torch

_lock = threading.Lock()
_enabled = os.environ.get("FLASH_ATTN_EXT_AUTOTUNE", "0") not in ("", "0", "false", "False")
_cache = {}            # key -> (num_splits, tile)
_cache_loaded = False
_stats = {"hits": 0, "tuned": 0}

TILE_AUTO, TILE_LARGE, TILE_SMALL_M, TILE_SMALL_M_KEY_WARPS = 0, 1, 2, 3
CANDIDATES = [(0, TILE_AUTO), (1, TILE_AUTO), (1, TILE_LARGE), (2, TILE_LARGE), (4, TILE_LARGE),
              (0, TILE_SMALL_M), (1, TILE_SMALL_M), (4, TILE_SMALL_M), (8, TILE_SMALL_M),
              (16, TILE_SMALL_M), (0, TILE_SMALL_M_KEY_WARPS), (1, TILE_SMALL_M_KEY_WARPS),
              (2, TILE_SMALL_M_KEY_WARPS)]


def enable(flag: bool = True) -> None:
    global _enabled
    _enabled = bool(flag)


def is_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def enabled(flag: bool = True):
    """Context manager: autotune on (or off) inside the block."""
    previous = _enabled
    enable(flag)
    try:
        yield
    finally:
        enable(previous)


def clear_cache() -> None:
    with _lock:
        _cache.clear()
        _stats.update(hits=0, tuned=0)


def cache_info() -> dict:
    """{'entries': {key_string: (num_splits, tile)}, 'hits': n, 'tuned': n}."""
    with _lock:
        return {"entries": {_key_str(k): v for k, v in _cache.items()}, **_stats}


def _bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _key(q, k, causal, causal_bottom_right):
    major, minor = torch.cuda.get_device_capability(q.device)
    head_dim = q.shape[3]
    rounded = 32 if head_dim <= 32 else (head_dim + 31) // 32 * 32
    causal_mode = ("causal_br" if causal_bottom_right else "causal_tl") if causal else "full"
    return (f"sm{major}{minor}", str(q.dtype).replace("torch.", ""), rounded, causal_mode,
            _bucket(q.shape[1]), _bucket(k.shape[1]), _bucket(q.shape[0] * q.shape[2]))


def _key_str(key) -> str:
    return "|".join(str(x) for x in key)


def _cache_path():
    return os.environ.get("FLASH_ATTN_EXT_AUTOTUNE_CACHE") or None


def _load_cache_file():
    global _cache_loaded
    if _cache_loaded:
        return
    _cache_loaded = True
    path = _cache_path()
    if not path or not os.path.exists(path):
        return
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"flash_attn_ext: cannot read the autotune cache {path}: {e}") from e
    for key_string, value in stored.items():
        parts = key_string.split("|")
        key = (parts[0], parts[1], int(parts[2]), parts[3], int(parts[4]), int(parts[5]),
               int(parts[6]))
        _cache[key] = (int(value[0]), int(value[1]))


def _save_cache_file():
    path = _cache_path()
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({_key_str(k): list(v) for k, v in _cache.items()}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _tunable(q) -> bool:
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)()
    if compiling or torch.cuda.is_current_stream_capturing():
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    return not isinstance(q, FakeTensor)


def _time_ms(fn, reps: int) -> float:
    fn()  # warm-up (and first-touch of the split-KV workspace)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def choose_forward_config(q, k, v, softmax_scale, causal, causal_bottom_right):
    """(num_splits, tile) for this call: cached, or timed now. (0, 0) = built-in defaults."""
    if not _tunable(q):
        return 0, TILE_AUTO
    key = _key(q, k, causal, causal_bottom_right)
    with _lock:
        _load_cache_file()
        if key in _cache:
            _stats["hits"] += 1
            return _cache[key]
    fwd = torch.ops.flash_attn_ext.fwd
    best, best_ms = (0, TILE_AUTO), float("inf")
    with torch.no_grad():
        for num_splits, tile in CANDIDATES:
            ms = _time_ms(lambda: fwd(q, k, v, softmax_scale, causal, causal_bottom_right,
                                      num_splits, tile), reps=5)
            if ms < best_ms * 0.98:  # ties go to the earlier (simpler) candidate
                best, best_ms = (num_splits, tile), ms
    with _lock:
        _cache[key] = best
        _stats["tuned"] += 1
        _save_cache_file()
    return best
