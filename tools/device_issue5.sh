#!/usr/bin/env bash
# The issue-5 measurements, sized for two back-to-back 600 s device calls on an H200 x2 host.
# Every step has its own time limit and writes JSON + log under $LOGS; a step cut short still
# leaves its per-pass lines (bench_stage1) or warm-up lines (bench_stage2).
#   part a:  bench_stage1 on GPU 0 alone while GPU 1 warms and times the compiled peers' step;
#            then bench_stage1 on GPUs 0 and 1 at once (2-rank scaling)
#   part b:  GPU 0: default budget, profile, loader with 8 workers, steps fed by the loader
#            (data wait); GPU 1 at the same time: the eager peers' step (one-GPU reference);
#            then DDP over both GPUs
#   part c:  what part b could not finish cold (each process compiles flex attention for ~3 min):
#            DDP over both GPUs, then the default budget with loader, fed steps and profile
# Parts a-c ran on 2026-11-30 (BENCHMARKS.md); d and e are what they could not finish, each
# with a whole call's time (bench_stage2 prints its compile time so far every 30 s):
#   part d:  DDP over both GPUs, the peers' step (against the one-GPU 303.4 ms)
#   part e:  GPU 0: default budget, loader, steps fed by the loader (data wait), profile;
#            GPU 1 at the same time: the compiled peers' step
# Usage: LOGS=$OUT DFLASH_COMMIT=<hash> bash tools/device_issue5.sh a|b|c|d|e
set -uo pipefail
LOGS=${LOGS:-/tmp/dflash-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WANDB_MODE=offline
case "${1:-}" in
  a)
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 tools/bench_stage1.py --codecs fp8 --out "$LOGS/s1_one.json" \
      --store-dir /tmp/s1-one > "$LOGS/s1_one.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 300 python3 tools/bench_stage2.py --compile --modes peer --steps 6 \
      --distinct-steps 1 --out "$LOGS/s2_compiled.json" > "$LOGS/s2_compiled.log" 2>&1 &
    wait
    for gpu in 0 1; do
      CUDA_VISIBLE_DEVICES=$gpu timeout 240 python3 tools/bench_stage1.py --codecs fp8 --out "$LOGS/s1_two_$gpu.json" \
        --store-dir "/tmp/s1-two-$gpu" > "$LOGS/s1_two_$gpu.log" 2>&1 &
    done
    wait
    grep -h '^\[' "$LOGS"/s1_*.log
    tail -n 8 "$LOGS/s2_compiled.log"
    ;;
  b)
    CUDA_VISIBLE_DEVICES=0 timeout 360 python3 tools/bench_stage2.py --modes default --steps 4 --distinct-steps 2 \
      --loader --workers 8 --fed-epochs 5 --profile /tmp/trace --out "$LOGS/s2_default.json" \
      > "$LOGS/s2_default.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 300 python3 tools/bench_stage2.py --modes peer --steps 10 --distinct-steps 1 \
      --out "$LOGS/s2_peer.json" > "$LOGS/s2_peer.log" 2>&1 &
    wait
    timeout 150 torchrun --nproc-per-node 2 tools/bench_stage2.py --modes peer --steps 10 --distinct-steps 1 \
      --out "$LOGS/s2_ddp.json" > "$LOGS/s2_ddp.log" 2>&1
    echo "ddp: rc=$?"
    tail -n 14 "$LOGS"/s2_*.log
    ;;
  c)
    timeout 230 torchrun --nproc-per-node 2 tools/bench_stage2.py --modes peer --steps 10 --distinct-steps 1 \
      --out "$LOGS/s2_ddp.json" > "$LOGS/s2_ddp.log" 2>&1
    echo "ddp: rc=$?"
    CUDA_VISIBLE_DEVICES=0 timeout 330 python3 tools/bench_stage2.py --modes default --steps 4 --distinct-steps 2 \
      --loader --workers 8 --fed-epochs 4 --profile /tmp/trace --out "$LOGS/s2_default.json" \
      > "$LOGS/s2_default.log" 2>&1
    echo "default: rc=$?"
    tail -n 14 "$LOGS"/s2_*.log
    ;;
  d)
    timeout 540 torchrun --nproc-per-node 2 tools/bench_stage2.py --modes peer --steps 10 --distinct-steps 1 \
      --out "$LOGS/s2_ddp.json" > "$LOGS/s2_ddp.log" 2>&1
    echo "ddp: rc=$?"
    tail -n 14 "$LOGS/s2_ddp.log"
    ;;
  e)
    CUDA_VISIBLE_DEVICES=0 timeout 560 python3 tools/bench_stage2.py --modes default --steps 4 --distinct-steps 2 \
      --loader --workers 8 --fed-epochs 4 --profile /tmp/trace --out "$LOGS/s2_default.json" \
      > "$LOGS/s2_default.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 560 python3 tools/bench_stage2.py --compile --modes peer --steps 6 \
      --distinct-steps 1 --out "$LOGS/s2_compiled.json" > "$LOGS/s2_compiled.log" 2>&1 &
    wait
    tail -n 24 "$LOGS"/s2_*.log
    ;;
  *)
    echo "usage: LOGS=DIR DFLASH_COMMIT=<hash> bash tools/device_issue5.sh a|b|c|d|e" >&2
    exit 2
    ;;
esac
