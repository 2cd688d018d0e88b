#!/usr/bin/env bash
# The small drafter's step under flex attention's kernel tile sizes (bench_stage2 --flex-options), one call.
# A fresh machine: the wheels first (INSTALL=1).
set -u
export PYTHONPATH=$PWD:/tmp/site
[ -n "${INSTALL:-}" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
S=(python3 tools/bench_stage2.py --target smollm2-135m --modes default --lengths 100,1500 --accum-steps 2 --compile
   --steps 20)
deadline=$(($(date +%s) + ${WAIT:-540}))
for v in "--anchor-budget 4096 --token-budget 16384 --flex-options BLOCK_M=64,BLOCK_N=64" \
         "--anchor-budget 8192 --token-budget 32768 --flex-options BLOCK_M=64,BLOCK_N=64" \
         "--anchor-budget 4096 --token-budget 16384 --flex-options BLOCK_M=32,BLOCK_N=64" \
         "--anchor-budget 4096 --token-budget 16384 --flex-options BLOCK_M=64,BLOCK_N=32" ${VARIANTS:-}; do
  left=$((deadline - $(date +%s) - 15)); limit=$(( left < 110 ? left : 110 ))
  [ $limit -gt 30 ] || { echo "== $v: no time left"; continue; }
  name=$(echo "$v" | tr -dc '0-9a-zA-Z')
  echo "== $v"
  timeout "$limit" "${S[@]}" $v --out "$OUT/tiles-$name.json" 2>&1 | grep -v Warning | tail -2
done
