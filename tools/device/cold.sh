#!/usr/bin/env bash
# Cold starts (issue 25): `cold.sh 27b` the default budget and the peers' step, `cold.sh small` the SmolLM2-sized
# drafter; each once with empty caches, then restarted from its compile artifacts.
set -u
export PYTHONPATH=$PWD:/tmp/site
B=(python3 tools/bench_stage2.py --compile --cold)
case ${1:-27b} in
  27b)
    timeout 200 "${B[@]}" --modes default --steps 4 --distinct-steps 2 --compile-artifacts /tmp/art-default.bin \
      --out "$OUT/cold-default.json" > "$OUT/cold-default.log" 2>&1
    timeout 120 "${B[@]}" --modes default --steps 4 --distinct-steps 2 --compile-artifacts /tmp/art-default.bin \
      --out "$OUT/warm-default.json" > "$OUT/warm-default.log" 2>&1
    timeout 150 "${B[@]}" --modes peer --steps 6 --distinct-steps 1 --compile-artifacts /tmp/art-peer.bin \
      --out "$OUT/cold-peer.json" > "$OUT/cold-peer.log" 2>&1
    # kernels compiled in the process, one at a time: each kernel's own seconds, and whether the worker pool's
    # wait (34.6 s of the default budget's 72.5 on 12-02) is more than the kernels' own compile time
    [ -n "${SERIAL:-}" ] && timeout 200 "${B[@]}" --cold-serial --modes default --steps 4 --distinct-steps 2 \
      --out "$OUT/cold-default-serial.json" > "$OUT/cold-default-serial.log" 2>&1 ;;
  small)
    S=("${B[@]}" --target smollm2-135m --modes default --lengths 100,1500 --token-budget 16384 --accum-steps 2
       --steps 20 --anchor-budget 4096 --compile-artifacts /tmp/art-small.bin)
    timeout 150 "${S[@]}" --out "$OUT/cold-small.json" > "$OUT/cold-small.log" 2>&1
    timeout 90 "${S[@]}" --out "$OUT/warm-small.json" > "$OUT/warm-small.log" 2>&1 ;;
esac
tail -n 5 "$OUT"/*.log
