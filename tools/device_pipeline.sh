#!/usr/bin/env bash
# The pipeline on one GPU, as issues 2 and 3 ran it (logs under $LOGS):
#   1. the embedded tiny default end to end on CUDA (fla kernels, flex attention, compile),
#   2. stage one over a small-but-real-shape target: 27B widths, 8 layers, random weights.
# Usage: LOGS=out/ bash tools/device_pipeline.sh
set -uo pipefail
LOGS=${LOGS:-/tmp/dflash-logs}
WORK=${WORK:-/tmp/dflash-work}
mkdir -p "$LOGS" "$WORK"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WANDB_MODE=offline
dflash=(python3 -m stages.cli)
tiny=(--set data.cache_dir="\"$WORK/tiny/cache\"" --set store.path="\"$WORK/tiny/store\"")
timeout 240 "${dflash[@]}" stage1-extract "${tiny[@]}" 2>&1 | tr '\r' '\n' | grep -v '^extract' > "$LOGS/tiny-stage1.log"
timeout 300 "${dflash[@]}" stage2-train "${tiny[@]}" --set train.out_dir="\"$WORK/tiny/run\"" --set train.max_steps=60 \
  --set train.eval_every=30 2>&1 | tr '\r' '\n' | grep -v '^train' > "$LOGS/tiny-stage2.log"
cp "$WORK/tiny/run/metrics.jsonl" "$LOGS/tiny-metrics.jsonl" 2>/dev/null
timeout 180 python3 tools/make_random_target.py --out "$WORK/random-27b-8l" --layers 8 > "$LOGS/real-shape-stage1.log" 2>&1
real=(--set target.path="\"$WORK/random-27b-8l\"" --set target.num_layer_ids=5 --set data.max_length=4096
      --set data.cache_dir="\"$WORK/real/cache\"" --set store.path="\"$WORK/real/store\""
      --set 'store.bucket_edges=[64, 256, 512, 1024, 2048, 3296, 4096]' --set store.shard_tokens=65536
      --set extract.batch_tokens=32768 --set train.token_budget=16384)
timeout 300 "${dflash[@]}" stage1-extract "${real[@]}" 2>&1 | tr '\r' '\n' | grep -v '^extract' >> "$LOGS/real-shape-stage1.log"
"${dflash[@]}" inspect-cache "$WORK/real/store" --verify >> "$LOGS/real-shape-stage1.log" 2>&1
tail -n 4 "$LOGS"/tiny-stage1.log "$LOGS"/tiny-stage2.log; tail -n 25 "$LOGS/real-shape-stage1.log"
