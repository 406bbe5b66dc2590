#!/usr/bin/env bash
# Drafters trained on the quick demo's data with the demo's target in full precision and with --target-fp8, seeds
# 0-2, each measured by `draftline eval` against both targets (docs/benchmarks/2026-12-target-fp8.md).
#
#   draftline demo --quick --out /tmp/qd          # the data (and one full-precision run)
#   bash bench/fp8_demo_quality.sh /tmp/qd/data /tmp/fp8q
#
# The training flags are the quick demo's (`draftline demo --quick` prints them), with fewer in-training measurements.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:?the data directory of the quick demo}
OUT=${2:?a directory for the runs}
T=src/draftline/demo/assets/tiny-target
P=src/draftline/demo/assets/prompts.jsonl
BIN=${BIN:-.venv/bin}
mkdir -p "$OUT"
for seed in 0 1 2; do
  for mode in full fp8; do
    run="$OUT/run-$mode-$seed"
    flag=(); [ "$mode" = fp8 ] && flag=(--target-fp8)
    "$BIN/draftline" train --target "$T" --data "$DATA" --out "$run" --from-scratch --gpus 2 --colocated --device cpu \
      --draft-layers 3 --block-size 8 --init-from-target --target-layer-ids 1,3,4 --method dflash --loss dpace \
      --max-anchors 16 --token-budget 1024 --epochs 5 --lr 0.002 --warmup-ratio 0.05 --log-every 10 --save-every 200 \
      --eval-prompts "$P" --eval-num-prompts 4 --eval-max-new-tokens 32 --eval-final-num-prompts 4 \
      --eval-final-max-new-tokens 32 --seed "$seed" --no-tensorboard "${flag[@]}" > "$run.log" 2>&1
    for target in full fp8; do
      tflag=(); [ "$target" = fp8 ] && tflag=(--target-fp8)
      json="$OUT/eval-$mode-$seed-vs-$target.json"
      "$BIN/draftline" eval --target "$T" --drafter "$run" --prompts "$P" --limit 24 --max-new-tokens 48 --block-size 8 \
        --json "$json" "${tflag[@]}" > "${json%.json}.log" 2>&1
      tau=$("$BIN/python" -c 'import json, sys; print(round(json.load(open(sys.argv[1]))["tau"], 4))' "$json")
      echo "$mode features, seed $seed, against the $target target: tau $tau"
    done
  done
done
