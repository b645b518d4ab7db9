"""The benchmarks (`python -m flash_attn_ext.bench [SUITE] --help`): the attention suite
(flash_attn_ext against naive attention, torch's SDPA backends and flex_attention in one
process, table printed last; the default) and the feature suites (decode, varlen, variants,
varlen-variants, paged-prefill, fp8, host-overhead, ring), all on one timing and reporting
layer.

  backends.py  what each attention backend runs, its inputs, FLOP and byte counts, env_set
  timing.py    medians per device, peak memory, start-up peaks, one backend's passes,
               rotated rounds, the CUDA check: shared by every suite
  report.py    CSV / JSON / PNG outputs (write_rows_csv for any suite's rows), the attention
               table, merging saved runs
  cli.py       the attention suite: arguments, the config grid, run_bench and its main
  suites/      the suite registry and dispatcher (main), one module per feature suite

The names below are the ones scripts (bench/*.py) and tests import from here; main is the
dispatcher (attention when the first argument is a flag).
"""
from .backends import (ALL_BACKENDS, DTYPES, PASS_FLOP_FACTOR, SDPA_BACKENDS, _pinned_to_mma,
                       _sdpa_backend_enum, env_set, flops, make_fn, make_inputs, min_bytes)
from .cli import parse_args, run_bench
from .report import (FLOPS_NOTE, _fmt, _geomean, load_runs, print_table, write_csv, write_json,
                     write_rows_csv)
from .suites import SUITES, main
from .timing import (Progress, Skip, _short_error, _time_pass, bench_backend, measure_peaks,
                     peak_extra_mb, require_cuda, rotated_rounds, time_ms, time_passes, timer_name)

__all__ = ["ALL_BACKENDS", "DTYPES", "FLOPS_NOTE", "PASS_FLOP_FACTOR", "Progress", "SDPA_BACKENDS",
           "SUITES", "Skip", "_fmt", "_geomean", "_pinned_to_mma", "_sdpa_backend_enum",
           "_short_error", "_time_pass", "bench_backend", "env_set", "flops", "load_runs", "main",
           "make_fn", "make_inputs", "measure_peaks", "min_bytes", "parse_args", "peak_extra_mb",
           "print_table", "require_cuda", "rotated_rounds", "run_bench", "time_ms", "time_passes",
           "timer_name", "write_csv", "write_json", "write_rows_csv"]
