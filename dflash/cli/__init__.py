"""`python -m dflash.cli` (its `__main__.py`) runs the command line, which lives in stages/cli.py."""
