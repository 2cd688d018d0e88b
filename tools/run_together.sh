#!/usr/bin/env bash
# The reference layout running together (issue 17): stage one on some GPUs, a stage two that
# follows the store (--follow) on the others; when stage one is done, stage two is stopped
# (SIGTERM: it saves a checkpoint at the next step) and resumed on all GPUs.
#
#   CONFIG=configs/qwen3.6-27b.toml EXTRACT_GPUS=0,1,2,3,4 TRAIN_GPUS=5,6,7 ALL_GPUS=0,1,2,3,4,5,6,7 \
#     ACCUM=8 bash tools/run_together.sh [--set KEY=VALUE ...]
#
# An optimizer step is GPUs x train.accum_steps micro-batches and a resume keeps it: pick ACCUM so
# that TRAIN_GPUS x ACCUM is a multiple of the GPUs in ALL_GPUS (3 x 8 = 24 = 8 x 3). Empty GPU lists
# run each stage as one process on its default device (the embedded tiny default on a CPU:
# `CONFIG= bash tools/run_together.sh`). Logs: $LOGS/stage1.log, stage2-follow.log, stage2-all.log.
set -uo pipefail
CONFIG=${CONFIG:-}
EXTRACT_GPUS=${EXTRACT_GPUS:-}
TRAIN_GPUS=${TRAIN_GPUS:-}
ALL_GPUS=${ALL_GPUS:-}
ACCUM=${ACCUM:-}
LOGS=${LOGS:-./together-logs}
mkdir -p "$LOGS"
config=()
[ -n "$CONFIG" ] && config=(-c "$CONFIG")
gpus() { [ -n "$1" ] && echo "--gpus $1"; }
accum=()
[ -n "$ACCUM" ] && accum=(--set "train.accum_steps=$ACCUM")

# shellcheck disable=SC2046
setsid dflash stage1-extract "${config[@]}" $(gpus "$EXTRACT_GPUS") "$@" > "$LOGS/stage1.log" 2>&1 &
stage1=$!
# shellcheck disable=SC2046
setsid dflash stage2-train "${config[@]}" $(gpus "$TRAIN_GPUS") --follow "${accum[@]}" "$@" \
  > "$LOGS/stage2-follow.log" 2>&1 &
stage2=$!
echo "stage one (pid $stage1) and a following stage two (pid $stage2) started; logs in $LOGS"
wait "$stage1"
status=$?
if [ $status -ne 0 ]; then
  echo "stage one failed (status $status, $LOGS/stage1.log); stage two keeps following until train.follow_timeout_s" >&2
  wait "$stage2"
  exit $status
fi
echo "stage one done"
if kill -0 "$stage2" 2> /dev/null; then
  kill -TERM -- "-$stage2"  # the whole group: the launcher, torchrun and every rank save and stop
  wait "$stage2"
  echo "stage two stopped with a checkpoint; resuming on ${ALL_GPUS:-one process}"
  # shellcheck disable=SC2046
  dflash stage2-train "${config[@]}" $(gpus "$ALL_GPUS") --resume "$@" 2>&1 | tee "$LOGS/stage2-all.log"
  exit "${PIPESTATUS[0]}"
fi
wait "$stage2"
