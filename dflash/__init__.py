"""dflash: offline two-stage training of DFlash speculative-decoding drafters."""

__version__ = "0.1.0"
