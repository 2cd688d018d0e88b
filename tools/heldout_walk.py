"""Moved into the library: `python -m dflash.train.walk` (dflash/train/walk.py), which `dflash recipe`
runs as its walk part. This wrapper keeps the old command line working."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.train.walk import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
