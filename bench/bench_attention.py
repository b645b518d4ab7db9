#!/usr/bin/env python3
"""Kept for scripts that call it by path: the benchmark lives in flash_attn_ext/bench/
(`python -m flash_attn_ext.bench --help`); same flags, same output."""
from flash_attn_ext.bench import main

if __name__ == "__main__":
    main()
