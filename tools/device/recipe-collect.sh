#!/usr/bin/env bash
# Device calls 3..: wait for the recipe (at most WAIT s), then copy its results and log tails into $OUT
# as one archive (a call brings back a limited number of files).
# COLD="serial default" (optional): once the recipe's evals have started (batch-1 decoding leaves the GPU and
# most cores idle), run cold.sh's default-budget cold starts beside them, in that order ("serial": kernels
# compiled in-process), each at most COLD_LIMIT s; their logs and JSON come back in the archive.
# SPEED=1 (optional): once the recipe has finished, speed.sh's step variants in the call's time left (each at
# most LIMIT s), into the archive's speed/.
# EXPORT=1 (optional): once the recipe has finished, the last checkpoint's export (about 39 MB for the SmolLM2
# drafter) as $OUT/export.tar.NN, parts of 15 MiB (a call brings back 8 files of at most 16 MiB); join them with
# `cat export.tar.* | tar x` to serve or study the drafter on the CPU (`dflash eval --device cpu`).
set -u
export PYTHONPATH=$PWD:/tmp/site
work=${WORK:-/tmp/rw}
deadline=$((SECONDS + ${WAIT:-560}))
if [ -n "${COLD:-}" ]; then
  until grep -q 'recipe: eval-.*: started' "$work/recipe.log" 2>/dev/null || [ $SECONDS -ge $deadline ] \
      || ! pgrep -f "stages.cli recipe" > /dev/null; do sleep 5; done
  mkdir -p /tmp/collect
  for variant in $COLD; do
    left=$((deadline - SECONDS - 40)); limit=${COLD_LIMIT:-100}; [ $left -lt $limit ] && limit=$left
    [ $limit -gt 30 ] || break
    flag=(); [ "$variant" = serial ] && flag=(--cold-serial)
    echo "[$(date +%H:%M:%S)] cold $variant (limit $limit s)" | tee -a /tmp/collect/cold.txt
    timeout "$limit" python3 tools/bench_stage2.py --compile --cold "${flag[@]}" --modes default --steps 4 \
      --distinct-steps 2 --out "/tmp/collect/cold-$variant.json" > "/tmp/collect/cold-$variant.log" 2>&1
    grep -a "first optimizer step\|graphs;\|Recompiling\|triggered by" "/tmp/collect/cold-$variant.log" | cut -c1-400 \
      | tee -a /tmp/collect/cold.txt
  done
fi
mkdir -p /tmp/collect/logs
while [ ! -f "$work/report.md" ] && [ $SECONDS -lt $deadline ] && pgrep -f "stages.cli recipe" > /dev/null; do
  sleep 10
done
mkdir -p /tmp/collect/results
cp -r "$work"/results "$work"/evals "$work"/plots "$work"/report.* /tmp/collect/results/ 2>/dev/null
cp "$work"/report.md "$OUT"/ 2>/dev/null
grep -a "recipe: " "$work/recipe.log" | tee "$OUT/progress.txt"
if [ -n "${SPEED:-}" ] && [ -f "$work/report.md" ]; then
  mkdir -p /tmp/collect/speed
  OUT=/tmp/collect/speed DEADLINE=$(($(date +%s) + deadline - SECONDS)) bash "$(dirname "$0")/speed.sh" 2>&1 | tee /tmp/collect/speed/speed.txt
fi
if [ -n "${EXPORT:-}" ] && [ -f "$work/report.md" ]; then
  tar cf - -C "$work/exports" export | split -b 15m -d - "$OUT/export.tar."
  ls -l "$OUT"/export.tar.*
fi
tr '\r' '\n' < "$work/recipe.log" | grep -av 'it/s\]\|s/it\]\|step/s\]\|answer/s\]\|tok/s\]' \
  | tail -c 60000 > /tmp/collect/logs/recipe.log
cp "$work"/drafter/metrics.jsonl /tmp/collect/ 2>/dev/null
grep -a -A4 "Recompiling function" "$work/recipe.log" 2>/dev/null | head -c 30000 > /tmp/collect/logs/recompiles.txt
tar czf "$OUT/logs.tgz" -C /tmp/collect . && rm -rf /tmp/collect/logs /tmp/collect/metrics.jsonl /tmp/collect/results
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
