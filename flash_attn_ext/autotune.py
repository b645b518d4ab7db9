"""Optional forward autotuning: time the compiled kernel variants on the real inputs and
remember the fastest per (GPU arch, dtype, head dim, causal, shape bucket).

Off by default: the built-in heuristics (tile table + FA2's split-KV rule) are what the
README's speed tables measure. Turn it on with

    FLASH_ATTN_EXT_AUTOTUNE=1 python train.py                 # whole process
    FLASH_ATTN_EXT_AUTOTUNE=tune.json python train.py         # ... winners kept in tune.json
    flash_attn_ext.autotune.enable()                          # from code
    flash_attn_ext.autotune.enable(cache="tune.json")         # ... with a cache file
    with flash_attn_ext.autotune.enabled(): ...               # a block

FLASH_ATTN_EXT_AUTOTUNE (read at import): unset, "", "0", "false", "off" leave it off;
"1", "true", "on" turn it on; any other value turns it on with that path as the cache file.
The first forward call of a new key times every candidate (a few ms to a few hundred ms,
once); later calls look the winner up. With a cache file, winners stored there by earlier
processes are read on first use and every new winner is written back (JSON).

Candidates: the built-in choice (tile=0, which on sm_90 is the Hopper wgmma kernel wherever
it applies, with the heuristic split count and forced unsplit) and the three tile families
of the mma.sync kernel (tile=1: the large per-head-dim tiles of
csrc/cuda/sm80/fwd_kernel_traits.cuh, tile=2: the 16-row one-warp tile used for decoding,
tile=3: the 16-row tile whose 4 warps split each key tile) times a few split-KV counts (0 =
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


def parse_env(value):
    """(enabled, cache_file) for a FLASH_ATTN_EXT_AUTOTUNE value (None = unset).

    >>> parse_env("1"), parse_env("0"), parse_env("/tmp/tune.json")
    ((True, None), (False, None), (True, '/tmp/tune.json'))
    """
    raw = (value or "").strip()
    if raw.lower() in ("", "0", "false", "off", "no"):
        return False, None
    if raw.lower() in ("1", "true", "on", "yes"):
        return True, None
    return True, raw


_lock = threading.Lock()
_enabled, _cache_file = parse_env(os.environ.get("FLASH_ATTN_EXT_AUTOTUNE"))
_cache = {}            # key -> (num_splits, tile)
_loaded_file = None    # the cache file whose entries _cache holds
_stats = {"hits": 0, "tuned": 0}

TILE_AUTO, TILE_LARGE, TILE_SMALL_M, TILE_SMALL_M_KEY_WARPS = 0, 1, 2, 3
CANDIDATES = [(0, TILE_AUTO), (1, TILE_AUTO), (1, TILE_LARGE), (2, TILE_LARGE), (4, TILE_LARGE),
              (0, TILE_SMALL_M), (1, TILE_SMALL_M), (4, TILE_SMALL_M), (8, TILE_SMALL_M),
              (16, TILE_SMALL_M), (0, TILE_SMALL_M_KEY_WARPS), (1, TILE_SMALL_M_KEY_WARPS),
              (2, TILE_SMALL_M_KEY_WARPS)]


def enable(flag: bool = True, cache=None) -> None:
    """Turn autotuning on (flag=True) or off for the forward calls that follow.

    cache: a JSON file path (str or os.PathLike) that keeps the winners across processes:
    read on the next lookup, rewritten after each new winner. None keeps the current file
    (FLASH_ATTN_EXT_AUTOTUNE's path, or the last one given); "" stops using a file.
    Applies to flash_attn_func / scaled_dot_product_attention / FlashAttnFunction calls
    with 16-bit CUDA q [batch, seqlen_q, heads, head_dim] that leave num_splits at 0.
    """
    global _enabled, _cache_file
    with _lock:
        _enabled = bool(flag)
        if cache is not None:
            _cache_file = os.fspath(cache) or None


def is_enabled() -> bool:
    """Whether forward calls are autotuned now."""
    return _enabled


def cache_file():
    """The JSON file that keeps the winners, or None (winners live in this process only)."""
    return _cache_file


@contextlib.contextmanager
def enabled(flag: bool = True, cache=None):
    """Context manager: autotune on (or off), optionally with a cache file (as enable()),
    inside the block; the previous setting and file come back afterwards."""
    previous = _enabled, _cache_file
    enable(flag, cache)
    try:
        yield
    finally:
        enable(previous[0], previous[1] or "")


def clear_cache() -> None:
    """Forget every winner in this process and reset the hit counters (a cache file is
    left as it is and read again on the next lookup)."""
    global _loaded_file
    with _lock:
        _cache.clear()
        _loaded_file = None
        _stats.update(hits=0, tuned=0)


def cache_info() -> dict:
    """{'entries': {key_string: (num_splits, tile)}, 'hits': n, 'tuned': n, 'file': path or
    None}. A key string is "smXY|dtype|rounded head dim|full or causal_br / causal_tl|
    seqlen_q bucket|seqlen_k bucket|batch*heads bucket" (powers of two)."""
    with _lock:
        return {"entries": {_key_str(k): v for k, v in _cache.items()}, **_stats,
                "file": _cache_file}


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


def _load_cache_file():
    """Merge the cache file's entries into _cache once per file (caller holds _lock)."""
    global _loaded_file
    path = _cache_file
    if not path or path == _loaded_file:
        return
    _loaded_file = path
    if not os.path.exists(path):
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
    path = _cache_file
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
    """(num_splits, tile) for this forward call: cached, or timed now; (0, 0) = the built-in
    defaults (always for CPU, fp32 and torch.compile tracing).

    q: [batch, seqlen_q, heads, head_dim]; k, v: [batch, seqlen_k, heads_k, head_dim], the
    operands of torch.ops.flash_attn_ext.fwd, which the candidates are timed with."""
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
