#!/usr/bin/env bash
# The issue-5 measurements still missing, sized for 600 s device calls on an H200 x2 host.
# Every step has its own time limit and writes JSON + log under $LOGS; a step cut short still
# leaves its per-pass lines (bench_stage1) or warm-up lines (bench_stage2).
#   part stage1:  bench_stage1 on GPU 0 alone, then on GPUs 0 and 1 at once (2-rank scaling)
#   part stage2:  compiled peers' step; eager default budget with loader, 8 workers, profile;
#                 DDP over 2 GPUs
# Usage: LOGS=$OUT DFLASH_COMMIT=<hash> bash tools/device_issue5.sh stage1|stage2
set -uo pipefail
LOGS=${LOGS:-/tmp/dflash-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WANDB_MODE=offline
case "${1:-}" in
  stage1)
    CUDA_VISIBLE_DEVICES=0 timeout 290 python3 tools/bench_stage1.py --codecs fp8 --out "$LOGS/s1_one.json" \
      --store-dir /tmp/s1-one > "$LOGS/s1_one.log" 2>&1
    echo "one rank: rc=$?"
    for gpu in 0 1; do
      CUDA_VISIBLE_DEVICES=$gpu timeout 250 python3 tools/bench_stage1.py --codecs fp8 --out "$LOGS/s1_two_$gpu.json" \
        --store-dir "/tmp/s1-two-$gpu" > "$LOGS/s1_two_$gpu.log" 2>&1 &
    done
    wait
    echo "two ranks: done"
    grep -h '^\[' "$LOGS"/s1_*.log
    ;;
  stage2)
    timeout 240 python3 tools/bench_stage2.py --compile --modes peer --steps 6 --distinct-steps 1 \
      --out "$LOGS/s2_compiled.json" > "$LOGS/s2_compiled.log" 2>&1
    echo "compiled peer: rc=$?"
    timeout 220 python3 tools/bench_stage2.py --modes default --steps 4 --distinct-steps 2 --loader --workers 8 \
      --profile /tmp/trace --out "$LOGS/s2_default.json" > "$LOGS/s2_default.log" 2>&1
    echo "default budget: rc=$?"
    timeout 120 torchrun --nproc-per-node 2 tools/bench_stage2.py --modes peer --steps 6 --distinct-steps 1 \
      --out "$LOGS/s2_ddp.json" > "$LOGS/s2_ddp.log" 2>&1
    echo "ddp: rc=$?"
    tail -n 12 "$LOGS"/s2_*.log
    ;;
  *)
    echo "usage: LOGS=DIR bash tools/device_issue5.sh stage1|stage2" >&2
    exit 2
    ;;
esac
