#!/usr/bin/env python3
"""Kept for the README's set-up command and scripts that call it by path: the same as
`python -m flash_attn_ext.bench` (flash_attn_ext/bench/; the attention suite by default, any
suite by name); same flags, same output."""
from flash_attn_ext.bench import main

if __name__ == "__main__":
    main()
