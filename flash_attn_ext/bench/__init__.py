"""The benchmark (`python -m flash_attn_ext.bench --help`): flash_attn_ext against naive
attention, torch's SDPA backends and flex_attention in one process, table printed last.

  backends.py  what each backend runs, its inputs, FLOP and byte counts
  timing.py    medians per device, peak memory, start-up peaks, rotated rounds
  report.py    CSV / JSON / PNG outputs, the printed table, merging saved runs
  cli.py       arguments, the config grid, run_bench and main

The names below are the ones scripts (bench/*.py) and tests import from here.
"""
from .backends import (ALL_BACKENDS, DTYPES, PASS_FLOP_FACTOR, SDPA_BACKENDS, _pinned_to_mma,
                       _sdpa_backend_enum, env_set, flops, make_fn, make_inputs, min_bytes)
from .cli import main, parse_args, run_bench
from .report import FLOPS_NOTE, _fmt, _geomean, load_runs, print_table, write_csv, write_json
from .timing import (Progress, _short_error, _time_pass, bench_backend, measure_peaks,
                     peak_extra_mb, rotated_rounds, time_ms, timer_name)

__all__ = ["ALL_BACKENDS", "DTYPES", "FLOPS_NOTE", "PASS_FLOP_FACTOR", "Progress", "SDPA_BACKENDS",
           "_fmt", "_geomean", "_pinned_to_mma", "_sdpa_backend_enum", "_short_error", "_time_pass",
           "bench_backend", "env_set", "flops", "load_runs", "main", "make_fn", "make_inputs",
           "measure_peaks", "min_bytes", "parse_args", "peak_extra_mb", "print_table",
           "rotated_rounds", "run_bench", "time_ms", "timer_name", "write_csv", "write_json"]
