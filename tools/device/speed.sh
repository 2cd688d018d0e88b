#!/usr/bin/env bash
# The SmolLM2-sized drafter's compiled step (issue 24's 100K tokens/s), variants side by side in one call.
set -u
export PYTHONPATH=$PWD:/tmp/site
S=(python3 tools/bench_stage2.py --target smollm2-135m --modes default --lengths 100,1500 --accum-steps 2 --compile
   --steps 20)
# the most wanted first (a deadline may cut the rest): the recipe's step (its 2 micro-batches fused, flex 64 x 64
# tiles for these 64-dim heads), the same unfused, twice the micro-batch, then inductor's own flex tiles
for variant in "--anchor-budget 4096 --token-budget 16384 --fuse-accum" "--anchor-budget 4096 --token-budget 16384" \
               "--anchor-budget 8192 --token-budget 32768" \
               "--anchor-budget 4096 --token-budget 16384 --flex-options default" \
               ${SPEED_VARIANTS:-}; do
  name=$(echo "$variant" | tr -dc '0-9a-zA-Z')
  limit=${LIMIT:-100}
  if [ -n "${DEADLINE:-}" ]; then  # a wall deadline, epoch seconds (recipe-collect.sh's SPEED=1): the time left, less 20 s
    left=$((DEADLINE - $(date +%s) - 20)); [ $left -lt $limit ] && limit=$left
    [ $limit -gt 30 ] || { echo "== $variant: no time left"; continue; }
  fi
  echo "== $variant"
  timeout "$limit" "${S[@]}" $variant --out "$OUT/speed-$name.json" 2>&1 | grep -v Warning | tail -3
done
# where the recipe's step spends its time (kernel time by class): PROFILE=1
[ -n "${PROFILE:-}" ] && timeout "${LIMIT:-100}" "${S[@]}" --anchor-budget 4096 --token-budget 16384 \
  --profile /tmp/prof --out "$OUT/speed-profile.json" 2>&1 | grep -v Warning | tail -40
