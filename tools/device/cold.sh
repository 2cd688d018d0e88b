#!/usr/bin/env bash
# Cold starts (issue 25): `cold.sh 27b` the default budget and the peers' step, `cold.sh small` the SmolLM2-sized
# drafter, `cold.sh all` the three in one call (about 6 minutes) and then the small drafter's step at twice the
# micro-batch and its profile (issue 24); each cold start once with empty caches, then restarted from its
# compile artifacts. Logs and JSON under $OUT; the last lines of each log at the end.
set -u
export PYTHONPATH=$PWD:/tmp/site
B=(python3 tools/bench_stage2.py --compile --cold)
S=("${B[@]}" --target smollm2-135m --modes default --lengths 100,1500 --accum-steps 2 --steps 20
   --compile-artifacts /tmp/art-small.bin)
run() {  # run NAME LIMIT COMMAND...: one bench process, its log and JSON under $OUT
  local name=$1 limit=$2; shift 2
  echo "[$(date +%H:%M:%S)] $name"
  timeout "$limit" "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
}
default=(--modes default --steps 4 --distinct-steps 2 --compile-artifacts /tmp/art-default.bin)
peer=(--modes peer --steps 6 --distinct-steps 1 --compile-artifacts /tmp/art-peer.bin)
case ${1:-27b} in
  27b|all)
    run cold-default 100 "${B[@]}" "${default[@]}"
    run warm-default 60 "${B[@]}" "${default[@]}"
    run cold-peer 80 "${B[@]}" "${peer[@]}"
    run warm-peer 45 "${B[@]}" "${peer[@]}"
    # kernels compiled in the process, one at a time: each kernel's own seconds
    [ -n "${SERIAL:-}" ] && run cold-default-serial 100 "${B[@]}" --cold-serial --modes default --steps 4 \
      --distinct-steps 2 ;;&
  small|all)
    run cold-small 90 "${S[@]}" --anchor-budget 4096 --token-budget 16384
    run warm-small 45 "${S[@]}" --anchor-budget 4096 --token-budget 16384 ;;&
  all)
    run small-8192 60 "${S[@]}" --anchor-budget 8192 --token-budget 32768
    run small-profile 70 "${S[@]}" --anchor-budget 4096 --token-budget 16384 --profile /tmp/prof ;;
esac
for f in "$OUT"/*.log; do echo "== $f"; grep -a "first optimizer step\|tokens/s\|^|" "$f" | grep -v "^| ---" | tail -n 14 | cut -c1-260; done
