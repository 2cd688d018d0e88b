#!/usr/bin/env bash
# The real-target recipe end to end on one GPU (issue 24): on-policy answers -> store -> drafter ->
# export -> served acceptance, with each part's wall time. Config: configs/smollm2-recipe.toml.
#
#   1. generate  `dflash generate`: greedy + $SAMPLES sampled answers (temperature $TEMPERATURE) to every
#                prompt of $SOURCE, up to $NEW_TOKENS tokens each
#                and (MORE_SOURCE, by default embedded:code-complete: HumanEval-worded prompts) the greedy
#                answer, and $MORE_SAMPLES (0) sampled ones, to its first 8,000 prompts (MORE_ARGS="--limit
#                8000"; 24,000 on 12-03, 16,000 before), into answers/more; MORE_SOURCE= (empty) leaves it out
#                and (ASK_SOURCE, by default embedded:ask-code: starts of coding requests) prompts the target
#                writes itself (`dflash generate --ask-temperature $ASK_TEMPERATURE`, 1) and answers greedily,
#                12,000 of them (ASK_ARGS="--limit 12000"), into answers/asked; ASK_SOURCE= leaves them out.
#                These two run side by side on the GPU (PARALLEL_GENERATES=1, the default) or in turn (0).
#                The held-out prompts are then a mix: MAIN_MATCH and MORE_MATCH (regular expressions of each
#                source's wording) pick $SOURCE's and MORE_SOURCE's for their evals
#   2. extract   `dflash stage1-extract` over the answers (target labels)
#   3. train     `dflash stage2-train`: train.holdout_by = prompt, so the held-out prompts' answers are
#                never trained on and its held-out tau is measured on the target's own answers
#   4. export    `dflash export` of the last checkpoint, and (CURVE=1, the default) of every earlier one
#   5. eval      `dflash eval` at temperature 0, $EVAL_PROMPTS x $EVAL_TOKENS each, for all those checkpoints
#                in one run each (one target load, one baseline per prompt: the served curve): on $SOURCE's
#                held-out prompts (eval-heldout) and on $EVAL_SOURCE (HumanEval, never trained on:
#                eval-humaneval); for the last one on MORE_SOURCE's held-out prompts (eval-heldout-more) and
#                (T1=1, the default) at temperature 1 on eval-heldout's prompts. The evals
#                run side by side on the GPU (PARALLEL_EVALS=1, the default: batch-1 decoding of a small
#                target leaves it mostly idle; their speedups are then measured beside each other) or in
#                turn (PARALLEL_EVALS=0, for speedups measured alone)
#   6. walk      tools/heldout_walk.py: stage two's teacher-forced tau walked as served on the very prompts the
#                temperature-0 held-out evals served (results/walk.json), beside their served tau
# Results: $WORK/results/timing.tsv (part, seconds), eval-*.json, the training log's held-out tau
# beside the served tau and the served curve against tokens seen (summary.txt). All of it under $WORK; logs under $LOGS.
#
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf WORK=/tmp/recipe bash tools/recipe.sh run       # foreground
#   GGUF=... WORK=/tmp/recipe bash tools/recipe.sh launch     # in the background (setsid), then:
#   WORK=/tmp/recipe bash tools/recipe.sh status
#   WORK=/tmp/recipe LOGS=$OUT bash tools/recipe.sh collect   # waits (at most $WAIT s), copies the results
# EXTRA="--set ..." adds overrides to every dflash command (a CPU dry run: CONFIG=configs/tiny.toml and
# small budgets); GENERATE_ARGS / EVAL_ARGS add options to those commands alone, MORE_ARGS to the generate of
# MORE_SOURCE alone (default "--limit 8000"), ASK_ARGS to that of ASK_SOURCE alone (default "--limit 12000").
set -uo pipefail
command=${1:?usage: recipe.sh run|launch|status|collect}
WORK=${WORK:-/tmp/dflash-recipe}
LOGS=${LOGS:-$WORK/logs}
CONFIG=${CONFIG:-configs/smollm2-recipe.toml}
SOURCE=${SOURCE:-embedded:code-docs}
SAMPLES=${SAMPLES:-3}
TEMPERATURE=${TEMPERATURE:-0.8}
NEW_TOKENS=${NEW_TOKENS:-512}
EVAL_SOURCE=${EVAL_SOURCE:-embedded:humaneval}
EVAL_PROMPTS=${EVAL_PROMPTS:-16}
EVAL_TOKENS=${EVAL_TOKENS:-128}
CURVE=${CURVE:-1}
MORE_SOURCE=${MORE_SOURCE-embedded:code-complete}  # MORE_SOURCE= (empty): the main source alone
MORE_SAMPLES=${MORE_SAMPLES:-0}
ASK_SOURCE=${ASK_SOURCE-embedded:ask-code}  # ASK_SOURCE= (empty): no prompts written by the target
ASK_TEMPERATURE=${ASK_TEMPERATURE:-1}
# Each source's held-out prompts by their wording: code-docs asks for "`name(...)`, a function of the Python
# module `m`" (or a method "in the Python module `m`"); code-complete's code block opens with "# module" alone
if [ "$SOURCE" = embedded:code-docs ] && [ -n "$MORE_SOURCE$ASK_SOURCE" ]; then MAIN_MATCH=${MAIN_MATCH-the Python module \`}; fi
MAIN_MATCH=${MAIN_MATCH-}
[ "$MORE_SOURCE" = embedded:code-complete ] && MORE_MATCH=${MORE_MATCH-'Complete the following Python function\.\s+```python\s+# [\w.]+\n'}
MORE_MATCH=${MORE_MATCH-}
T1=${T1:-1}
PARALLEL_EVALS=${PARALLEL_EVALS:-1}
PARALLEL_GENERATES=${PARALLEL_GENERATES:-1}
WAIT=${WAIT:-520}
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
dflash=(python3 -m stages.cli)
read -ra extra <<< "${EXTRA:-}"
read -ra generate_args <<< "${GENERATE_ARGS:-}"
read -ra eval_args <<< "${EVAL_ARGS:-}"
read -ra more_extra <<< "${MORE_ARGS---limit 8000}"
read -ra ask_extra <<< "${ASK_ARGS---limit 12000}"
common=(-c "$CONFIG" --set "data.cache_dir=$WORK/cache" --set "data.source=$WORK/answers"
        --set "store.path=$WORK/store" --set "train.out_dir=$WORK/drafter" ${GGUF:+--set "target.path=$GGUF"} "${extra[@]}")

part() {  # part NAME COMMAND...: run it, log it, record its wall seconds; stop the recipe if it fails
  local name=$1; shift
  local start=$SECONDS
  echo "[$(date +%H:%M:%S)] $name: $*" | tee -a "$WORK/results/progress.txt"
  "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  printf '%s\t%d\t%d\n' "$name" $((SECONDS - start)) "$rc" >> "${TIMING:-$WORK/results/timing.tsv}"
  echo "[$(date +%H:%M:%S)] $name: rc $rc after $((SECONDS - start)) s" | tee -a "$WORK/results/progress.txt"
  [ "$rc" -eq 0 ] || [ -n "${SOFT:-}" ] || { tail -n 30 "$WORK/logs/$name.log"; exit "$rc"; }
}

recipe() {
  mkdir -p "$WORK/logs" "$WORK/results"
  : > "$WORK/results/timing.tsv"
  local start=$SECONDS
  # the source rows go through `dflash generate` whole: the held-out split is made later, by prompt
  part generate "${dflash[@]}" generate "${common[@]}" --set "data.source=$SOURCE" --out "$WORK/answers" \
    --max-new-tokens "$NEW_TOKENS" --temperature "$TEMPERATURE" --num-samples "$SAMPLES" --with-greedy \
    "${generate_args[@]}"
  generate_more() {  # more prompts, their own answer count; stage one reads answers/ recursively
    local more_args=(--temperature 0)
    [ "$MORE_SAMPLES" -gt 0 ] && more_args=(--temperature "$TEMPERATURE" --num-samples "$MORE_SAMPLES" --with-greedy)
    part generate-more "${dflash[@]}" generate "${common[@]}" --set "data.source=$MORE_SOURCE" \
      --out "$WORK/answers/more" --max-new-tokens "$NEW_TOKENS" "${more_args[@]}" "${generate_args[@]}" \
      "${more_extra[@]}"
  }
  generate_asked() {  # the target writes the prompts from their starts, then answers them greedily
    part generate-asked "${dflash[@]}" generate "${common[@]}" --set "data.source=$ASK_SOURCE" \
      --out "$WORK/answers/asked" --max-new-tokens "$NEW_TOKENS" --temperature 0 --ask-temperature "$ASK_TEMPERATURE" \
      "${generate_args[@]}" "${ask_extra[@]}"
  }
  # Side by side (PARALLEL_GENERATES=1, the default): each spends about 45 s starting (loading, tokenizing,
  # graphs) and its decoding leaves the GPU room (each engine's KV cache: at most 1,024 slots, about 26 GB here)
  local generates=()
  [ -n "$MORE_SOURCE" ] && generates+=(generate_more)
  [ -n "$ASK_SOURCE" ] && generates+=(generate_asked)
  [ ${#generates[@]} -gt 0 ] && side_by_side "generates" "$PARALLEL_GENERATES" "${generates[@]}"
  part extract "${dflash[@]}" stage1-extract "${common[@]}"
  # TORCH_LOGS=recompiles (the default here; TORCH_LOGS= turns it off) names every recompile's failed guard in train.log
  part train env "TORCH_LOGS=${TORCH_LOGS-recompiles}" "${dflash[@]}" stage2-train "${common[@]}"
  local checkpoint
  checkpoint=$(ls -d "$WORK"/drafter/checkpoints/step-* | sort | tail -n 1)
  part export "${dflash[@]}" export "$checkpoint" "$WORK/export"
  local drafters=(--drafter "$WORK/export")
  if [ "$CURVE" = 1 ]; then  # the served curve: every earlier checkpoint, served beside the last one
    for earlier in $(ls -d "$WORK"/drafter/checkpoints/step-* | sort | head -n -1); do
      local step=${earlier##*step-}
      part "export-$step" "${dflash[@]}" export "$earlier" "$WORK/export-$step"
      drafters+=(--drafter "$WORK/export-$step")
    done
  fi
  # One eval for the last checkpoint and the curve's: the target loads once and decodes each prompt's
  # baseline once; results[0] is the last checkpoint.
  eval_part() {  # eval_part NAME OPTIONS...: `dflash eval` with the recipe's prompt budget, into results/NAME.json
    local name=$1; shift
    part "$name" "${dflash[@]}" eval "${common[@]}" "$@" --num-prompts "$EVAL_PROMPTS" \
      --max-new-tokens "$EVAL_TOKENS" --out "$WORK/results/$name.json" "${eval_args[@]}"
  }
  # The held-out prompts of $SOURCE alone: the other sources' answers sort first, so the first held-out
  # prompts by row would be theirs; MAIN_MATCH (its wording, a regular expression) picks them.
  local heldout=(--prompts heldout)
  [ -n "$MAIN_MATCH" ] && heldout+=(--match "$MAIN_MATCH")
  eval_heldout() { eval_part eval-heldout "${drafters[@]}" "${heldout[@]}"; }
  # (soft: a split that held none of MORE_SOURCE's prompts out loses this eval alone)
  eval_heldout_more() { SOFT=1 eval_part eval-heldout-more --drafter "$WORK/export" --prompts heldout --match "$MORE_MATCH"; }
  eval_humaneval() { eval_part eval-humaneval "${drafters[@]}" --prompts "$EVAL_SOURCE"; }
  eval_heldout_t1() { eval_part eval-heldout-t1 --drafter "$WORK/export" "${heldout[@]}" --temperature 1; }
  local more_eval=0  # MORE_SOURCE's held-out prompts are served (and walked) where its wording is known
  [ -n "$MORE_SOURCE" ] && [ -n "$MORE_MATCH" ] && more_eval=1
  local evals=(eval_heldout)
  [ "$more_eval" = 1 ] && evals+=(eval_heldout_more)
  evals+=(eval_humaneval)
  [ "$T1" = 1 ] && evals+=(eval_heldout_t1)
  side_by_side "evals" "$PARALLEL_EVALS" "${evals[@]}"
  # Stage two's teacher-forced walk on the very prompts the temperature-0 evals served (each prompt's greedy
  # answer in the store, through the checkpoint behind each export); a failure here leaves the summary without it
  local walked=(--eval "$WORK/results/eval-heldout.json")
  [ "$more_eval" = 1 ] && walked+=(--eval "$WORK/results/eval-heldout-more.json")
  SOFT=1 part walk python3 tools/heldout_walk.py "${common[@]}" --checkpoints "$WORK/drafter/checkpoints" \
    "${walked[@]}" --out "$WORK/results/walk.json"
  summarize $((SECONDS - start)) | tee "$WORK/results/summary.txt"
}

side_by_side() {  # side_by_side LABEL PARALLEL FUNCTION...: parts at once on the one GPU (PARALLEL=1) or in turn
  local label=$1 parallel=$2; shift 2
  if [ "$parallel" != 1 ]; then
    local job
    for job in "$@"; do "$job"; done
    return
  fi
  # Batch-1 decoding of a small target is bound by the host's launches, so the GPU has room for several;
  # each part logs its own time (into its own file, gathered in order), then "LABEL (side by side)" the wall time of all.
  local start=$SECONDS pids=() job pid rc failed=0
  for job in "$@"; do
    ( TIMING=$WORK/results/timing-$job.tsv; : > "$TIMING"; "$job" ) &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid"; rc=$?
    [ "$rc" -eq 0 ] || failed=$rc
  done
  for job in "$@"; do
    cat "$WORK/results/timing-$job.tsv" >> "$WORK/results/timing.tsv" && rm -f "$WORK/results/timing-$job.tsv"
  done
  printf '%s (side by side)\t%d\t%d\n' "$label" $((SECONDS - start)) "$failed" >> "$WORK/results/timing.tsv"
  [ "$failed" -eq 0 ] || exit "$failed"
}

summarize() {  # the parts' times, the last held-out teacher-forced tau and the served taus
  echo "recipe: $1 s end to end"
  awk -F'\t' '{printf "  %-20s %6d s  (rc %d)\n", $1, $2, $3}' "$WORK/results/timing.tsv"
  python3 - "$WORK" "$SOURCE" "${MORE_SOURCE:-none}" "$EVAL_SOURCE" <<'PY'
import json, re, sys
from pathlib import Path
work = Path(sys.argv[1])
lines = [json.loads(line) for line in (work / "drafter" / "metrics.jsonl").read_text().splitlines()]
held = [line for line in lines if "eval/tau" in line]
plan = re.search(r"train: ([\d,]+) tokens, ([\d,]+) of them answer tokens", (work / "logs" / "train.log").read_text())
unique, answers = (int(group.replace(",", "")) for group in plan.groups()) if plan else (0, 0)
if unique:
    print(f"  training split: {unique:,} tokens, {answers:,} of them the target's answers (unique data)")
recompiles = (work / "logs" / "train.log").read_text().count("Recompiling function")
windows = [line for line in lines if "tokens_per_s" in line]
if len(windows) >= 2:  # stage two's rate: the median logging window (held-out evaluations fall in few), the whole loop
    rates = sorted(line["tokens_per_s"] for line in windows[1:])
    loop = (windows[-1]["tokens_seen"] - windows[0]["tokens_seen"]) / max(windows[-1]["time"] - windows[0]["time"], 1e-9)
    print(f"  stage two: {rates[len(rates) // 2]:,.0f} tokens/s in the median window, {loop:,.0f} over the loop "
          f"after the first window (held-out evaluations and checkpoints included)")
print(f"  recompiles while training: {recompiles} (TORCH_LOGS=recompiles: logs/train.log names each one's guard)")
asked_log = work / "logs" / "generate-asked.log"  # ASK_SOURCE: how many prompts the target wrote, and ended
asked = re.findall(r"asked: the target wrote .*?answered; dropped [^(]*", asked_log.read_text()) if asked_log.exists() else []
if asked:
    print(f"  {asked[-1].strip().rstrip(',')}")
if held:
    print(f"  teacher-forced held-out tau {held[-1]['eval/tau']:.3f} at step {held[-1]['step']}")
if held and "eval/served_tau" in held[-1]:  # train.eval_served_tokens: walked as serving walks the answers
    print(f"  teacher-forced held-out tau as served {held[-1]['eval/served_tau']:.3f} "
          f"({held[-1]['eval/served_answers']:.0f} greedy held-out answers, train.eval_served_tokens)")
sources = dict(zip(("main", "more", "eval"), sys.argv[2:5]))
evals = {"eval-heldout": f"{sources['main']}'s held-out prompts", "eval-heldout-more": f"{sources['more']}'s held-out prompts",
         "eval-humaneval": sources["eval"], "eval-heldout-t1": f"{sources['main']}'s held-out prompts"}
served = {}  # eval name -> its results, the last checkpoint's first
for name, prompts in evals.items():
    path = work / "results" / f"{name}.json"
    if path.exists():
        served[name] = results = json.loads(path.read_text())["results"]
        result = results[0]
        print(f"  served tau ({name}: {prompts}, temperature {result['temperature']:g}): {result['tau']:.3f} over "
              f"{result['num_prompts']} prompts, speedup {result['speedup']:.2f}x")
        if result.get("verifications_in_code"):  # dflash eval: verifications starting inside ``` blocks, and outside
            print(f"    inside code blocks {result['tau_in_code']:.3f} ({result['verifications_in_code']} verifications), "
                  f"outside {result['tau_outside_code']:.3f} ({result['verifications_outside_code']})")
walk_path = work / "results" / "walk.json"  # tools/heldout_walk.py: the same prompts, teacher-forced as served
walks = json.loads(walk_path.read_text())["walks"] if walk_path.exists() else []
for entry in walks:
    print(f"  teacher-forced as served on {Path(entry['eval']).stem}'s own prompts ({entry['checkpoint'].rsplit('/', 1)[-1]}, "
          f"{entry['walked_prompts']} with a greedy answer in the store): {entry['teacher_forced_tau']:.3f} beside "
          f"served {entry['served_tau_same_prompts']:.3f} on them ({100 * (entry['ratio'] - 1):+.1f}%)")
walk_by_drafter = {entry["drafter"]: entry for entry in walks if entry["eval"].endswith("eval-heldout.json")}
seen = {line["step"]: line["tokens_seen"] for line in lines if "tokens_seen" in line}
held_by_step = {line["step"]: line["eval/tau"] for line in held}
served_by_step = {line["step"]: line["eval/served_tau"] for line in held if "eval/served_tau" in line}
curve = served.get("eval-heldout", [])
humaneval = {result["drafter"]: result["tau"] for result in served.get("eval-humaneval", [])}
curve = curve[1:] + curve[:1]  # the earlier checkpoints in order, then the last one
last_step = max((line["step"] for line in lines), default=0)  # the last checkpoint's
if len(curve) > 1:
    print(f"  served curve (temperature 0): step, tokens seen, teacher-forced held-out tau, teacher-forced as served, "
          f"the same on eval-heldout's prompts, served tau on them, served tau on {sources['eval']}")
    for result in curve:
        tail = result["drafter"].rstrip("/").split("-")[-1]
        step = int(tail) if tail.isdigit() else last_step
        tokens = seen.get(max((s for s in seen if s <= step), default=0), 0)
        tf, walked = held_by_step.get(step), served_by_step.get(step)
        passes = f" ({tokens / unique:.1f} passes)" if unique else ""
        same = walk_by_drafter.get(result["drafter"], {}).get("teacher_forced_tau")
        other = humaneval.get(result["drafter"])
        print(f"    {step}, {tokens:,.0f}{passes}, {tf if tf is None else round(tf, 3)}, "
              f"{walked if walked is None else round(walked, 3)}, {same if same is None else round(same, 3)}, "
              f"{result['tau']:.3f}, {other if other is None else round(other, 3)}")
PY
}

case $command in
  run) recipe ;;
  launch)
    mkdir -p "$WORK/logs" "$WORK/results"
    setsid nohup bash "$0" run > "$WORK/logs/recipe.log" 2>&1 < /dev/null &
    echo "launched (pid $!); WORK=$WORK" ;;
  status) cat "$WORK/results/progress.txt" 2>/dev/null; tail -c 2000 "$WORK/logs/recipe.log" 2>/dev/null ;;
  collect)
    deadline=$((SECONDS + WAIT))
    while [ ! -f "$WORK/results/summary.txt" ] && [ $SECONDS -lt $deadline ] && pgrep -f "recipe.sh run" > /dev/null; do
      sleep 10
    done
    mkdir -p "$LOGS"
    cp "$WORK"/results/* "$LOGS"/ 2>/dev/null
    tail -c 20000 "$WORK/logs/recipe.log" > "$LOGS/recipe.log" 2>/dev/null
    cat "$WORK/results/progress.txt" "$WORK/results/summary.txt" 2>/dev/null ;;
  *) echo "usage: recipe.sh run|launch|status|collect" >&2; exit 2 ;;
esac
