#!/usr/bin/env bash
# Device calls 3..: wait for the recipe (at most WAIT s), then copy its results and log tails into $OUT
# as one archive (a call brings back a limited number of files).
set -u
export PYTHONPATH=$PWD:/tmp/site
work=${WORK:-/tmp/rw}
WORK=$work LOGS=$OUT WAIT=${WAIT:-560} bash tools/recipe.sh collect
mkdir -p /tmp/collect/logs
for f in "$work"/logs/*.log; do tr '\r' '\n' < "$f" | grep -av 'it/s\]\|s/it\]\|step/s\]\|answer/s\]\|tok/s\]' \
  | tail -c 20000 > "/tmp/collect/logs/$(basename "$f")"; done
cp "$work"/drafter/metrics.jsonl /tmp/collect/ 2>/dev/null
tar czf "$OUT/logs.tgz" -C /tmp/collect . && rm -rf /tmp/collect
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
