#!/usr/bin/env bash
# Device call 2: join the GGUF, launch tools/recipe.sh in the background, wait up to WAIT s, copy results to $OUT.
set -u
export PYTHONPATH=$PWD:/tmp/site
cat /tmp/smol.aa .gguf-parts/p2/smol.ab > /tmp/smol.gguf
sha256sum /tmp/smol.gguf | tee "$OUT/sha.txt"  # b179c952...
echo "code ${DFLASH_COMMIT:-?}" | tee "$OUT/commit.txt"
GGUF=/tmp/smol.gguf WORK=${WORK:-/tmp/rw} bash tools/recipe.sh launch
sleep 5
exec bash "$(dirname "$0")/recipe-collect.sh"
