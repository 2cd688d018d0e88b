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
# Parts a-c ran on 2026-11-30 (docs/benchmarks-log.md); d and e are what they could not finish, each
# with a whole call's time (bench_stage2 prints its compile time so far every 30 s):
#   part d:  DDP over both GPUs, the peers' step (against the one-GPU 303.4 ms)
#   part e:  GPU 0: default budget, loader, steps fed by the loader (data wait), profile;
#            GPU 1 at the same time: the compiled peers' step
#   part f:  part e with the host's cores split in half between the two GPUs' processes (so the
#            data wait is measured with a single-GPU host's 16 cores, not under the other GPU's
#            compile), and the compile caches packed into $LOGS/inductor-cache.tgz.* for part g
#   part g:  DDP over both GPUs (compile caches from part f unpacked first if carried in
#            .cache-carry/). Only rank 0 finds its graphs there: inductor's cache keys name the
#            device index, and rank 1 (cuda:1) compiles cold, ~290 s, while rank 0 waits in NCCL
#   part h:  stage one on both GPUs at once, each with half the cores (the writer hand-off slots
#            on the GPU; ~5 min cold: flash-linear-attention autotunes first)
#   part i:  GPU 0: the compiled default budget and its profile; GPU 1: stage one (one rank)
#   part j:  part i again after the stage-one host fixes (mask-free capture, one-core hand-off copies,
#            niced writers), stage one with its profiler timeline; stage two adds the loader-fed steps
#   part k:  stage one alone on a one-GPU H200 host (16 cores): its rate over the forward span, the full path
#            without prefaulted slots for comparison (a flag of 0496679, since removed: prefaulting was slower),
#            and the profiler timeline (full-path trace gzipped to $LOGS)
# Parts f and g ran on 2026-11-30 (g's DDP step came from the same torchrun command given 450 s).
# Usage: LOGS=$OUT DFLASH_COMMIT=<hash> bash tools/device_issue5.sh a|b|c|d|e|f|g|h|i|j|k
set -uo pipefail
LOGS=${LOGS:-/tmp/dflash-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WANDB_MODE=offline
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
START=$SECONDS
half_cores() {  # half_cores 0|1: the first or second half of this host's cores, for taskset
  local n; n=$(nproc); local h=$((n / 2))
  if [ "$1" = 0 ]; then echo "0-$((h - 1))"; else echo "$h-$((n - 1))"; fi
}
pin_to() { if command -v taskset > /dev/null; then taskset -c "$(half_cores "$1")" "${@:2}"; else "${@:2}"; fi; }
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
  f)
    echo "cores: $(nproc); GPU 0 process on $(half_cores 0), GPU 1 process on $(half_cores 1)"
    CUDA_VISIBLE_DEVICES=0 pin_to 0 timeout 555 python3 tools/bench_stage2.py --modes default --steps 4 \
      --distinct-steps 2 --loader --workers 8 --fed-epochs 4 --profile /tmp/trace --out "$LOGS/s2_default.json" \
      > "$LOGS/s2_default.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 pin_to 1 timeout 555 python3 tools/bench_stage2.py --compile --modes peer --steps 6 \
      --distinct-steps 1 --out "$LOGS/s2_compiled.json" > "$LOGS/s2_compiled.log" 2>&1 &
    wait
    tar czf /tmp/inductor-cache.tgz -C "$TORCHINDUCTOR_CACHE_DIR" . && du -h /tmp/inductor-cache.tgz
    split -b 15M -d -a 1 /tmp/inductor-cache.tgz "$LOGS/inductor-cache.tgz."
    ls "$LOGS"/inductor-cache.tgz.* | wc -l | awk '$1 > 3 {print "cache too large to carry back"}'
    tail -n 24 "$LOGS"/s2_*.log
    ;;
  g)
    if ls .cache-carry/inductor-cache.tgz.* > /dev/null 2>&1; then
      mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
      cat .cache-carry/inductor-cache.tgz.* | tar xzf - -C "$TORCHINDUCTOR_CACHE_DIR"
      echo "compile cache from part f unpacked: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1)"
    fi
    timeout 560 torchrun --nproc-per-node 2 tools/bench_stage2.py --modes peer --steps 10 --distinct-steps 1 \
      --out "$LOGS/s2_ddp.json" > "$LOGS/s2_ddp.log" 2>&1
    echo "ddp: rc=$? after $((SECONDS - START)) s"
    tail -n 14 "$LOGS/s2_ddp.log"
    ;;
  h)
    for gpu in 0 1; do
      CUDA_VISIBLE_DEVICES=$gpu pin_to $gpu timeout 560 python3 tools/bench_stage1.py --codecs fp8 \
        --out "$LOGS/s1_two_$gpu.json" --store-dir "/tmp/s1-two-$gpu" > "$LOGS/s1_two_$gpu.log" 2>&1 &
    done
    wait
    grep -h '^\[' "$LOGS"/s1_*.log
    ;;
  i)
    # What issue 5 still lacks, in one call: the compiled default budget (with the profile's
    # per-step sync count since a0f05e6) on GPU 0, stage one with the hand-off slots on GPU 1.
    # Part f's compile cache, if carried in .cache-carry/, spares the graphs both share (both on cuda:0).
    if ls .cache-carry/inductor-cache.tgz.* > /dev/null 2>&1; then
      mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
      cat .cache-carry/inductor-cache.tgz.* | tar xzf - -C "$TORCHINDUCTOR_CACHE_DIR"
    fi
    CUDA_VISIBLE_DEVICES=0 pin_to 0 timeout 570 python3 tools/bench_stage2.py --compile --modes default --steps 4 \
      --distinct-steps 2 --profile /tmp/trace --out "$LOGS/s2_default_compiled.json" \
      > "$LOGS/s2_default_compiled.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 pin_to 1 timeout 570 python3 tools/bench_stage1.py --codecs fp8 --out "$LOGS/s1_one.json" \
      --store-dir /tmp/s1-one > "$LOGS/s1_one.log" 2>&1 &
    wait
    grep -h '^\[' "$LOGS"/s1_one.log
    tail -n 30 "$LOGS/s2_default_compiled.log"
    ;;
  j)
    if ls .cache-carry/inductor-cache.tgz.* > /dev/null 2>&1; then
      mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
      cat .cache-carry/inductor-cache.tgz.* | tar xzf - -C "$TORCHINDUCTOR_CACHE_DIR"
    fi
    CUDA_VISIBLE_DEVICES=0 pin_to 0 timeout 570 python3 tools/bench_stage2.py --compile --modes default --steps 4 \
      --distinct-steps 2 --loader --workers 8 --fed-epochs 4 --out "$LOGS/s2_default_compiled_fed.json" \
      > "$LOGS/s2_default_compiled_fed.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 pin_to 1 timeout 570 python3 tools/bench_stage1.py --codecs fp8 --profile /tmp/s1-profile \
      --out "$LOGS/s1_one.json" --store-dir /tmp/s1-one > "$LOGS/s1_one.log" 2>&1 &
    wait
    grep -h '^\[' "$LOGS"/s1_one.log
    sed -n '/## stage one/,$p' "$LOGS/s1_one.log"
    tail -n 30 "$LOGS/s2_default_compiled_fed.log"
    ;;
  k)
    timeout 560 python3 tools/bench_stage1.py --codecs fp8 --profile /tmp/s1-profile \
      --out "$LOGS/s1_one.json" --store-dir /tmp/s1-one > "$LOGS/s1_one.log" 2>&1
    gzip -c /tmp/s1-profile/bench_stage1_full_path.json > "$LOGS/s1_full_trace.json.gz"
    grep -h '^\[' "$LOGS"/s1_one.log
    sed -n '/## stage one/,$p' "$LOGS/s1_one.log"
    ;;
  *)
    echo "usage: LOGS=DIR DFLASH_COMMIT=<hash> bash tools/device_issue5.sh a|b|c|d|e|f|g|h|i|j|k" >&2
    exit 2
    ;;
esac
