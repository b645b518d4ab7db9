"""Ring (context-parallel) attention, flash_attn_ext.distributed: every rank's output, lse and
gradients against single-process flash_attn_func over the whole sequence and against the
float64 reference with FlashAttention's rule (tests/helpers.py).

The CPU cases run in one spawned gloo group of 2 processes and one of 4 (spawning costs about
2-3 s of CPU per process, so each group runs all its cases, and each case is reported as its
own test). In the 4-process group some cases run on two 2-rank subgroups at once ({0, 2} and
{1, 3}), which checks the `group=` argument with group ranks that differ from global ranks.
The GPU tests run larger cases (about 1k tokens, head dims 32 to 128, fp32 / fp16 / bf16,
padded and packed) and the bad-input cases with NCCL on min(4, device_count) GPUs, and a
1-GPU NCCL smoke test.
"""
import datetime
import json
import os
import traceback
from typing import NamedTuple, Tuple, Union

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_attn_ext import flash_attn_func, flash_attn_varlen_func
from flash_attn_ext.distributed import (ring_flash_attn_func, ring_flash_attn_varlen_func,
                                        zigzag_shard, zigzag_shard_varlen, zigzag_unshard,
                                        zigzag_unshard_varlen)
from helpers import (assert_fa_rule, check_lse, gqa_attention, max_err, ref_and_base,
                     varlen_attention)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
JOIN_TIMEOUT_S = 240  # a hung ring fails the tests instead of hanging them


class Case(NamedTuple):
    """One comparison. seqlen: an int is the whole sequence of a [batch, seqlen, heads, dim]
    batch, sharded over the ring's ranks zig-zag when causal (seqlen a multiple of the ring
    size), else by torch.tensor_split (shard lengths may differ by one); a tuple is the
    sequence lengths of a packed batch (ring_flash_attn_varlen_func, zigzag_shard_varlen,
    each length a multiple of the ring size)."""
    causal: bool
    dtype: str
    seqlen: Union[int, Tuple[int, ...]]
    heads: int = 4
    heads_k: int = 2
    head_dim: int = 16
    batch: int = 2
    softcap: float = 0.0
    sink: bool = False  # a learnable sink (its gradient summed over the ranks)
    ring: str = "world"  # "pairs": two 2-rank subgroups {0, 2} and {1, 3} at once

    @property
    def varlen(self):
        return isinstance(self.seqlen, tuple)

    @property
    def name(self):
        gqa = "mha" if self.heads_k == self.heads else f"gqa{self.heads}-{self.heads_k}"
        extra = (f"-softcap{self.softcap:g}" if self.softcap else "") + \
            ("-sink" if self.sink else "")
        seq = f"varlen{'+'.join(map(str, self.seqlen))}" if self.varlen else f"S{self.seqlen}"
        return (f"{'causal' if self.causal else 'full'}-{self.dtype}-{seq}-{gqa}"
                f"-D{self.head_dim}{extra}-{self.ring}")


CPU_CASES = {
    2: [Case(True, "fp32", 74),                       # local 37 (chunks of 19 and 18)
        Case(True, "bf16", 74, heads_k=1),            # MQA
        Case(True, "fp32", 2, heads_k=4),             # local 1: every second chunk is empty
        Case(True, "fp32", 64, softcap=5.0),
        Case(True, "bf16", 74, sink=True),
        Case(False, "fp32", (10, 2, 0, 74, 6), sink=True),
        Case(False, "fp32", 75, heads_k=4),           # shards of 38 and 37
        Case(False, "bf16", 64),
        Case(True, "fp32", (10, 2, 0, 74, 6)),        # local 5, 1, 0, 37, 3 per sequence
        Case(False, "bf16", (12, 4, 30), heads_k=1)],
    # 3 ranks: the backward passes K/V blocks as well as the dK/dV accumulators.
    3: [Case(True, "fp32", 90),                       # local 15 (chunks of 8 and 7)
        Case(False, "fp32", 31, sink=True),
        Case(False, "bf16", 31, heads_k=1)],          # shards of 11, 10 and 10
    4: [Case(True, "fp32", 148),                      # local 37
        Case(True, "bf16", 148, heads_k=1),
        Case(False, "bf16", 83),                      # shards of 21, 21, 21 and 20
        Case(False, "fp32", 64, heads_k=4),
        Case(True, "bf16", (8, 4, 148, 0, 20)),
        Case(False, "fp32", (4, 36, 12), heads_k=4),
        Case(True, "bf16", 74, ring="pairs"),
        Case(False, "fp32", 75, ring="pairs"),
        Case(True, "fp32", (10, 2, 6), ring="pairs")],
}

# Inputs that must raise on every rank of a 2-rank group, before any block moves.
ERROR_CASES = ["causal_unequal_lengths", "mixed_causal_flags", "bad_input_on_rank_1",
               "bad_sink_on_rank_1",
               "heads_differ", "varlen_cu_seqlens_differ", "varlen_bad_cu_seqlens_on_rank_1",
               "varlen_length_not_divisible"]

# Causal lengths are multiples of 12: zig-zag shards on 2, 3 or 4 GPUs (odd, 255 and 63, on 4).
GPU_CASES = [Case(True, "bf16", 1020, heads=8, heads_k=2, head_dim=128),
             Case(True, "fp16", 1020, heads=8, heads_k=8, head_dim=64),
             Case(True, "fp32", 252, heads=4, heads_k=1, head_dim=64),
             Case(False, "bf16", 1013, heads=8, heads_k=2, head_dim=128),
             Case(False, "fp32", 259, heads=4, heads_k=4, head_dim=32),
             Case(True, "bf16", (1020, 12, 0, 120, 516), heads=8, heads_k=2, head_dim=128),
             Case(False, "fp16", (36, 1020, 12), heads=8, heads_k=8, head_dim=64),
             Case(True, "bf16", 1020, heads=8, heads_k=2, head_dim=64, sink=True)]
GPU_PAIR_CASES = [Case(True, "bf16", 1020, heads=8, heads_k=2, head_dim=128, ring="pairs")]


# ---- what every rank runs -------------------------------------------------------------------
def _shard_of(case, rank, world, cu_seqlens):
    """The function taking a full tensor (sequence along `dim`) to this rank's shard."""
    if case.varlen:
        return lambda t, dim=0: zigzag_shard_varlen(t, cu_seqlens, rank, world, dim=dim)
    if case.causal:
        return lambda t, dim=1: zigzag_shard(t, rank, world, dim=dim)
    return lambda t, dim=1: t.tensor_split(world, dim=dim)[rank]


def _check_case(case, group, device):
    """Runs `case` on this rank of `group` and asserts its results (every rank builds the
    same full inputs from the same seed and keeps its own shard)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype = DTYPES[case.dtype]
    gen = torch.Generator().manual_seed(1234)

    def randn(heads):
        rows = (sum(case.seqlen),) if case.varlen else (case.batch, case.seqlen)
        return torch.randn(rows + (heads, case.head_dim), generator=gen).to(device, dtype)

    full_q, full_k, full_v, full_dout = (randn(h) for h in (case.heads, case.heads_k,
                                                            case.heads_k, case.heads))
    sink = torch.randn(case.heads, generator=gen).to(device) if case.sink else None
    options = dict(causal=case.causal, softcap=case.softcap, return_lse=True)
    variant = dict(softcap=case.softcap, learnable_sink=sink)
    if case.varlen:
        cu = torch.tensor((0,) + case.seqlen).cumsum(0).to(device=device, dtype=torch.int32)
        longest = max(case.seqlen)

        def ring(q, k, v, s):
            return ring_flash_attn_varlen_func(q, k, v, cu, group=group, learnable_sink=s,
                                               **options)

        def single(q, k, v, s):
            return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, learnable_sink=s,
                                          **options)

        def reference(q, k, v, s=None):
            return varlen_attention(q, k, v, cu, cu, case.causal, **dict(variant,
                                                                          learnable_sink=s))
    else:
        cu = None

        def ring(q, k, v, s):
            return ring_flash_attn_func(q, k, v, group=group, learnable_sink=s, **options)

        def single(q, k, v, s):
            return flash_attn_func(q, k, v, learnable_sink=s, **options)

        def reference(q, k, v, s=None):
            return gqa_attention(q, k, v, case.causal, **dict(variant, learnable_sink=s))
    shard = _shard_of(case, rank, world, cu)
    lse_seq_dim = 1 if case.varlen else 2  # lse is [heads, total] or [batch, heads, seqlen]

    local = [shard(t).detach().requires_grad_() for t in (full_q, full_k, full_v)]
    local_sink = None if sink is None else sink.clone().requires_grad_()
    out, lse = ring(*local, local_sink)
    grads = torch.autograd.grad(out, local + ([local_sink] if case.sink else []),
                                shard(full_dout))
    leaves = [t.detach().requires_grad_() for t in (full_q, full_k, full_v)]
    single_sink = None if sink is None else sink.clone().requires_grad_()
    single_out, single_lse = single(*leaves, single_sink)
    single_grads = torch.autograd.grad(single_out, leaves + ([single_sink] if case.sink else []),
                                       full_dout)
    inputs = (full_q, full_k, full_v) + ((sink,) if case.sink else ())
    ref, base = ref_and_base(reference, inputs, full_dout)
    if case.sink:
        # Each rank's d_sink covers its rows: their sum is the whole sequence's (what data /
        # context parallel training's gradient all-reduce of a replicated parameter forms).
        dsink = grads[3].clone()
        dist.all_reduce(dsink, group=group)
        assert_fa_rule(dsink, ref[2][3], base[2][3], 3, atol=1e-4, what="dsink")
        tol = 1e-4 * max(1.0, single_grads[3].abs().max().item())
        assert max_err(dsink, single_grads[3]) <= (tol if dtype == torch.float32 else
                                                   3 * max_err(base[2][3], ref[2][3]) + tol)
        grads, single_grads = grads[:3], single_grads[:3]
        ref = (ref[0], ref[1], ref[2][:3])
        base = (base[0], base[1], base[2][:3])

    names = ("out", "dq", "dk", "dv")
    for name, ours, single, exact, naive in zip(names, (out, *grads), (single_out, *single_grads),
                                                (ref[0], *ref[2]), (base[0], *base[2])):
        assert ours.dtype == dtype and ours.shape == shard(single).shape, name
        factor = 2 if name == "out" else 3
        assert_fa_rule(ours, shard(exact), shard(naive), factor, atol=1e-5, what=name)
        # Against our own single-process kernels: the ring only changes the summation order
        # (and, in 16 bits, rounds each block's output before the fp32 merge).
        if dtype == torch.float32:
            tol = 2e-5 * max(1.0, shard(exact).abs().max().item())
        else:
            tol = factor * max_err(shard(naive), shard(exact))
        err = max_err(ours, shard(single))
        assert err <= tol, f"{name}: ring vs single-process max error {err:.3e} > {tol:.3e}"
    check_lse(lse, shard(ref[1].float(), dim=lse_seq_dim), dtype)
    assert max_err(lse, shard(single_lse, dim=lse_seq_dim)) <= 1e-4


def _expect_error(run, *fragments):
    try:
        run()
    except (RuntimeError, ValueError) as e:
        assert any(f in str(e) for f in fragments), f"unexpected message: {e}"
        return
    raise AssertionError(f"no error; expected one mentioning {fragments}")


def _check_error_case(name, device):
    """Bad inputs on a rank, or ranks that disagree: every rank raises (none is left waiting
    in the ring), with one of the expected messages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    causal = {"mixed_causal_flags": rank == 0, "heads_differ": False}.get(name, True)
    if name.startswith("varlen"):
        cu = {("varlen_cu_seqlens_differ", 1): [0, 2, 8],
              ("varlen_bad_cu_seqlens_on_rank_1", 1): [0, 6, 4],   # decreasing
              ("varlen_length_not_divisible", rank): [0, 3, 8]}.get((name, rank), [0, 4, 8])
        q = torch.randn(8 // world, 4, 8, device=device)
        call = lambda: ring_flash_attn_varlen_func(q, q, q, cu, causal=causal)  # noqa: E731
    else:
        length = 6 + rank if name == "causal_unequal_lengths" else 6
        heads = 4 + 2 * rank if name == "heads_differ" else 4
        q = torch.randn(1, length, heads, 8, device=device)
        if name == "bad_input_on_rank_1" and rank == 1:
            q = q[0]  # 3-D
        sink = (torch.zeros(3 if rank == 1 else 4, device=device)
                if name == "bad_sink_on_rank_1" else None)
        call = lambda: ring_flash_attn_func(q, q, q, causal=causal, learnable_sink=sink)  # noqa: E731
    expected = {"causal_unequal_lengths": ("same batch, shard length",),
                "mixed_causal_flags": ("same causal flag",),
                "bad_input_on_rank_1": ("4-D tensor", "rank(s) [1]"),
                "bad_sink_on_rank_1": ("learnable_sink must have shape", "rank(s) [1]"),
                "heads_differ": ("same batch, heads, heads_k",),
                "varlen_cu_seqlens_differ": ("same (global) cu_seqlens",),
                "varlen_bad_cu_seqlens_on_rank_1": ("non-decreasing", "rank(s) [1]"),
                "varlen_length_not_divisible": ("divisible",)}[name]
    _expect_error(call, *expected)


def _worker(rank, world, backend, device_type, store_path, result_dir, cases, error_cases):
    """One rank: runs every case, records None or the traceback per case in a JSON file."""
    torch.set_num_threads(1)  # several ranks share few cores
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (not needed)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    # Every rank creates every group, in the same order (torch.distributed's rule).
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])] if world == 4 else None
    results = {}
    for case in cases:
        group = pairs[rank % 2] if case.ring == "pairs" else None
        try:
            _check_case(case, group, device)
            results[case.name] = None
        except Exception:  # noqa: BLE001  (reported by the test of that case)
            results[case.name] = traceback.format_exc()
    for name in error_cases:
        try:
            _check_error_case(name, device)
            results[name] = None
        except Exception:  # noqa: BLE001
            results[name] = traceback.format_exc()
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world, backend, device_type, cases, error_cases, tmp_dir):
    """Runs _worker on `world` spawned processes; returns {case name: [traceback or None per
    rank]}."""
    context = mp.start_processes(_worker, nprocs=world, join=False, start_method="spawn",
                                 args=(world, backend, device_type, str(tmp_dir / "store"),
                                       str(tmp_dir), cases, error_cases))
    deadline = JOIN_TIMEOUT_S
    while not context.join(timeout=5):
        deadline -= 5
        if deadline <= 0:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world}-process ring did not finish in {JOIN_TIMEOUT_S} s")
    per_rank = []
    for rank in range(world):
        with open(tmp_dir / f"rank{rank}.json") as f:
            per_rank.append(json.load(f))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def _assert_passed(results, *names):
    failures = [f"{name}, rank {r}:\n{tb}" for name in names
                for r, tb in enumerate(results[name]) if tb is not None]
    assert not failures, "\n".join(failures)


# ---- CPU, gloo --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """{world: results}; each world size is spawned once, on its first use."""
    runs = {}

    def results(world):
        if world not in runs:
            runs[world] = _spawn(world, "gloo", "cpu", CPU_CASES[world],
                                 ERROR_CASES if world == 2 else [],
                                 tmp_path_factory.mktemp(f"gloo{world}"))
        return runs[world]
    return results


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CPU_CASES.items() for c in cases],
                         ids=lambda x: x.name if isinstance(x, Case) else f"world{x}")
def test_ring_cpu(gloo_results, world, case):
    _assert_passed(gloo_results(world), case.name)


@pytest.mark.parametrize("name", ERROR_CASES)
def test_ring_bad_inputs_raise_on_every_rank(gloo_results, name):
    _assert_passed(gloo_results(2), name)


def test_exported_lazily_from_the_package():
    import flash_attn_ext
    from flash_attn_ext import distributed
    for name in distributed.__all__:
        assert name in flash_attn_ext.__all__
        assert getattr(flash_attn_ext, name) is getattr(distributed, name)


def test_ring_needs_a_process_group():
    assert not dist.is_initialized()
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_flash_attn_func(q, q, q)


@pytest.mark.parametrize("world,seqlen", [(1, 5), (2, 8), (2, 74), (3, 9), (4, 148)])
def test_zigzag_shard_round_trip(world, seqlen):
    x = torch.arange(2 * seqlen).view(2, seqlen)
    shards = [zigzag_shard(x, r, world) for r in range(world)]
    assert all(s.shape == (2, seqlen // world) for s in shards)
    assert torch.equal(zigzag_unshard(shards), x)
    chunks = x.tensor_split(2 * world, dim=1)
    assert torch.equal(shards[0], torch.cat((chunks[0], chunks[-1]), dim=1))
    # Along another dim, e.g. lse [batch, heads, seqlen].
    y = x.view(1, 2, seqlen)
    assert torch.equal(zigzag_unshard([zigzag_shard(y, r, world, dim=2) for r in range(world)],
                                      dim=2), y)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zigzag_shard_varlen_round_trip(world):
    lengths = [3 * world, 0, world, 6 * world]
    cu = torch.tensor([0] + lengths).cumsum(0).int()
    x = torch.arange(2 * sum(lengths)).view(sum(lengths), 2)
    shards = [zigzag_shard_varlen(x, cu, r, world) for r in range(world)]
    assert all(s.shape == (sum(lengths) // world, 2) for s in shards)
    assert torch.equal(zigzag_unshard_varlen(shards, cu), x)
    # Each rank: its first chunk of every sequence, then its second chunk of every sequence.
    per_sequence = [zigzag_shard(x[a:b].unsqueeze(0), 0, world).squeeze(0)
                    for a, b in zip(cu.tolist(), cu.tolist()[1:])]
    firsts = [t[:(t.shape[0] + 1) // 2] for t in per_sequence]
    seconds = [t[(t.shape[0] + 1) // 2:] for t in per_sequence]
    assert torch.equal(shards[0], torch.cat(firsts + seconds))
    with pytest.raises(ValueError, match="divisible"):
        zigzag_shard_varlen(x[:-1], [0, sum(lengths) - 1], 0, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_chunk_sums_fold_past_the_held_pieces(dtype):
    """The backward's gradient sums per chunk (_ChunkSums) with more pieces than it holds
    (folded into an fp32 sum on the way, as 5+ ranks need): the fp32 sum in arrival order,
    rounded once; a chunk no piece covers is zeroed."""
    from flash_attn_ext import distributed as ring
    chunks = [slice(0, 3), slice(3, 5), slice(5, 6)]
    spans = [slice(0, 5)] * 6 + [slice(0, 3)] * 5 + [slice(3, 5)] * 3
    gen = torch.Generator().manual_seed(1)
    pieces = [torch.randn(2, s.stop - s.start, 3, 8, generator=gen).to(dtype) for s in spans]
    result = torch.full((2, 6, 3, 8), float("nan"), dtype=dtype)
    sums = ring._ChunkSums(chunks, ring._touches(chunks, spans), 1, result)
    expect = torch.zeros(2, 6, 3, 8)
    for span, piece in zip(spans, pieces):
        sums.add(span, piece)
        expect[:, span] += piece.float()
    assert sums.finish() is result
    torch.testing.assert_close(result, expect.to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_chunk_merges_fold_past_the_held_blocks(dtype):
    """The forward's merges per chunk (_ChunkMerges) with more blocks than it holds (folded
    into an fp32 running result on the way): the log-sum-exp merge of every block (float64
    reference); a chunk no block covers gets zeros and lse -inf."""
    from flash_attn_ext import distributed as ring
    chunks = [slice(0, 3), slice(3, 5), slice(5, 6)]
    spans = [slice(0, 5)] * 6 + [slice(0, 3)] * 5 + [slice(3, 5)] * 3
    gen = torch.Generator().manual_seed(2)
    outs = [torch.randn(2, s.stop - s.start, 3, 8, generator=gen).to(dtype) for s in spans]
    lses = [torch.randn(2, 3, s.stop - s.start, generator=gen) * 2 for s in spans]
    out = torch.full((2, 6, 3, 8), float("nan"), dtype=dtype)
    lse = torch.full((2, 3, 6), float("-inf"))
    merges = ring._ChunkMerges(chunks, ring._touches(chunks, spans), 1, out, lse)
    num = torch.zeros(2, 6, 3, 8, dtype=torch.float64)
    all_lse = [[] for _ in range(6)]
    for span, o, s in zip(spans, outs, lses):
        merges.add(span, o, s)
        for row in range(span.start, span.stop):
            all_lse[row].append((o[:, row - span.start].double(), s[..., row - span.start]))
    expect_lse = torch.full((2, 3, 6), float("-inf"), dtype=torch.float64)
    for row, terms in enumerate(all_lse):
        if terms:
            expect_lse[..., row] = torch.logsumexp(torch.stack([t[1].double() for t in terms]), 0)
            for o, s in terms:
                num[:, row] += torch.exp(s.double() - expect_lse[..., row]).unsqueeze(-1) * o
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), num, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), expect_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("device, head_dim, seqlen_local", [
    ("cpu", 16, 24), pytest.param("cuda", 64, 384, marks=pytest.mark.gpu),
    pytest.param("cuda", 128, 384, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("batch", [1, 2])
def test_ring_schedule_without_communication(device, head_dim, seqlen_local, world, batch):
    """Every rank's multi-step schedule on one device (the benchmarks' communicate=False
    ring, whose fetches return this rank's own K/V): the same as attention over the whole
    sequence whose every shard is a copy of this one. Checks out and dq, which add up over
    the steps in _ChunkMerges and _DqAccumulator (the backward operators' dq_accum, which
    the Hopper kernel adds into), for batch 1 and 2 (the accumulator's slices), GQA."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flash_attn_ext import distributed as ring_module
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(world * 10 + batch)
    shape, shape_k = (batch, seqlen_local, 4, head_dim), (batch, seqlen_local, 2, head_dim)
    q, k, v, dout = (torch.randn(s, generator=gen).to(device, dtype)
                     for s in (shape, shape_k, shape_k, shape))
    whole = [zigzag_unshard([t] * world) for t in (q, k, v, dout)]
    refs = []
    for ref_dtype in (torch.float64, dtype):
        q_g, k_g, v_g = (t.to(ref_dtype).requires_grad_() for t in whole[:3])
        out_g, _ = gqa_attention(q_g, k_g, v_g, causal=True)
        dq_g, = torch.autograd.grad(out_g, q_g, whole[3].to(ref_dtype))
        refs.append((out_g.detach(), dq_g))
    scale = head_dim ** -0.5
    for rank in range(world):
        ring = object.__new__(ring_module._Ring)
        ring.group, ring.rank, ring.world, ring.communicate = None, rank, world, False
        attention = ring_module._PaddedAttention((seqlen_local,) * world, True, scale, 0.0, False)
        q_r = q.clone().requires_grad_()
        out, _ = ring_module._RingFlashAttnFunction.apply(q_r, k, v, None, ring, attention,
                                                          None)
        dq, = torch.autograd.grad(out, q_r, dout)
        (out64, dq64), (out_base, dq_base) = (
            [zigzag_shard(t, rank, world) for t in ref] for ref in refs)
        assert_fa_rule(out, out64, out_base, 2, what=f"rank {rank} out")
        assert_fa_rule(dq, dq64, dq_base, 3, atol=1e-4, what=f"rank {rank} dq")


def test_zigzag_shard_bad_arguments():
    x = torch.zeros(1, 10)
    with pytest.raises(ValueError, match="divisible"):
        zigzag_shard(x, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        zigzag_shard(x, 2, 2)
    with pytest.raises(ValueError, match="same length"):
        zigzag_unshard([torch.zeros(1, 4), torch.zeros(1, 5)])


# ---- CUDA, NCCL -------------------------------------------------------------------------------
@pytest.mark.gpu
def test_ring_nccl_multi_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 GPUs")
    world = min(4, torch.cuda.device_count())
    cases = GPU_CASES + (GPU_PAIR_CASES if world == 4 else [])
    results = _spawn(world, "nccl", "cuda", cases, ERROR_CASES, tmp_path)
    _assert_passed(results, *results)


@pytest.mark.gpu
def test_ring_nccl_p2p_multi_gpu(tmp_path, monkeypatch):
    """The K/V transfers by NCCL P2P (symmetric memory switched off), one causal case, one
    not, one packed."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 GPUs")
    monkeypatch.setenv("FLASH_ATTN_EXT_RING_SYMMETRIC_MEMORY", "0")  # read by the children
    world = min(4, torch.cuda.device_count())
    results = _spawn(world, "nccl", "cuda", [GPU_CASES[i] for i in (0, 3, 5)], [], tmp_path)
    _assert_passed(results, *results)


@pytest.mark.gpu
def test_ring_nccl_single_gpu(tmp_path):
    bf16_cases = [c for c in GPU_CASES if c.dtype == "bf16"]  # one causal, one not
    results = _spawn(1, "nccl", "cuda", bf16_cases, [], tmp_path)
    _assert_passed(results, *results)
