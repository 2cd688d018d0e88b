#!/usr/bin/env bash
# Device call 2: join the GGUF, launch `dflash recipe` in the background, wait up to WAIT s, copy results to $OUT.
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
cat /tmp/smol.aa .gguf-parts/p2/smol.ab > /tmp/smol.gguf
sha256sum /tmp/smol.gguf | tee "$OUT/sha.txt"  # b179c952...
echo "code ${DFLASH_COMMIT:-?}" | tee "$OUT/commit.txt"
work=${WORK:-/tmp/rw}
mkdir -p "$work"
setsid nohup python3 -m stages.cli recipe -c configs/smollm2-recipe.toml --set target.path=/tmp/smol.gguf \
  --set "recipe.run_dir=$work" > "$work/recipe.log" 2>&1 < /dev/null &
echo "launched (pid $!); WORK=$work"
sleep 5
exec bash "$(dirname "$0")/recipe-collect.sh"
