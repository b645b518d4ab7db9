"""`python -m flash_attn_ext.bench [SUITE] [options]`: see suites/__init__.py."""
from .suites import main

main()
