"""The benchmark suites and the one entry point, `python -m flash_attn_ext.bench [SUITE]
[options]`: main() picks the suite named by the first argument (attention when the first
argument is a flag or absent, so every command line of the attention benchmark runs as
before) and hands it the rest.

Each suite is a module with its own flags, --help, table (printed last) and CSV / JSON
writing; they share the timing layer (flash_attn_ext.bench.timing: time_ms, time_passes,
rotated_rounds, require_cuda) and the CSV / JSON writers (flash_attn_ext.bench.report). A
suite's module is imported only when it runs: ring's imports torch.distributed, fp8's needs
CUDA.
"""
import importlib
import sys

# name -> (module, function, one line for the suite list). The attention suite is the
# package's original CLI (flash_attn_ext.bench.cli); the others moved here from bench/*.py.
SUITES = {
    "attention": ("flash_attn_ext.bench.cli", "main",
                  "dense attention: ours vs naive, torch SDPA backends, flex_attention, FA4 "
                  "(the default)"),
    "decode": ("flash_attn_ext.bench.suites.features", "main_decode",
               "GQA KV-cache decode in GB/s: contiguous, paged, FP8 caches vs SDPA backends"),
    "varlen": ("flash_attn_ext.bench.suites.features", "main_varlen",
               "packed variable-length sequences vs padded SDPA, torch varlen_attn, FA4 varlen"),
    "variants": ("flash_attn_ext.bench.suites.variants", "main",
                 "window / softcap / ALiBi / attn_mask / dropout / sink vs our plain kernel, "
                 "flex, cuDNN"),
    "varlen-variants": ("flash_attn_ext.bench.suites.varlen_variants", "main",
                        "varlen forward with variants: Hopper kernels vs mma.sync (CUDA)"),
    "paged-prefill": ("flash_attn_ext.bench.suites.paged_prefill", "main",
                      "a prefill chunk against a contiguous vs paged KV cache"),
    "mla-decode": ("flash_attn_ext.bench.suites.mla_decode", "main",
                   "DeepSeek MLA's absorbed decode (576 / 512 latent cache) in GB/s"),
    "fp8": ("flash_attn_ext.bench.suites.fp8", "main",
            "FP8 (e4m3) forward vs our bf16 forward, cuDNN and FA2 (CUDA, Hopper)"),
    "host-overhead": ("flash_attn_ext.bench.suites.host_overhead", "main",
                      "host time per tiny call: our entry points vs torch SDPA"),
    "ring": ("flash_attn_ext.bench.suites.ring", "main",
             "ring attention (context parallelism) over 1..8 GPUs, or gloo on the CPU"),
}

PROG = "python -m flash_attn_ext.bench"


def suite_list():
    """The suites, one line each (the top of `python -m flash_attn_ext.bench --help`)."""
    width = max(map(len, SUITES))
    lines = [f"suites (`{PROG} SUITE --help`: a suite's flags; without SUITE,",
             "i.e. with a flag first, the attention suite runs, whose flags follow):"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, _, summary) in SUITES.items()]
    return "\n".join(lines)


def suite_main(name):
    """The main(argv) function of suite `name`."""
    module, function, _ = SUITES[name]
    return getattr(importlib.import_module(module), function)


def main(argv=None):
    """`python -m flash_attn_ext.bench [SUITE] [options]`: runs the suite and returns what its
    main returns (the rows, for most)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "attention"
    if argv and not argv[0].startswith("-"):
        if argv[0] not in SUITES:
            raise SystemExit(f"{PROG}: unknown suite {argv[0]!r}; choose from "
                             f"{', '.join(SUITES)} (or start with a flag: the attention suite)")
        name = argv.pop(0)
    return suite_main(name)(argv)
