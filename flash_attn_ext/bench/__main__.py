"""`python -m flash_attn_ext.bench`: see cli.py."""
from .cli import main

main()
