#!/usr/bin/env bash
# Device call 1: the wheels the image lacks into /tmp/site, the GGUF's first part to /tmp.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
cp .gguf-parts/p1/smol.aa /tmp/
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
