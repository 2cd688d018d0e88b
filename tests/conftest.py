"""Test set-up: CPU-only runs must not route Qwen3.5 linear attention to fla's Triton kernels.

When CUDA is absent, make `fla` unimportable before transformers is imported, so
transformers uses its pure-torch Gated DeltaNet path (ENVIRONMENT.md).
"""

import sys

import torch

if not torch.cuda.is_available():
    sys.modules["fla"] = None  # importing fla now raises ImportError
