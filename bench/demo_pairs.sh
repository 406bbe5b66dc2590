#!/usr/bin/env bash
# Runs the demo as `make demo` would after a 2.5-minute set-up, on two cores at a time of a larger CPU
# host (the GPU hidden), on the fastest of its core pairs: each pair's probe first, then N demos at once.
#   bash bench/demo_pairs.sh OUT [N=2] [PAIRS="0,1 2,3 4,5 6,7 8,9 10,11 12,13 14,15"]
# A PYTHONPATH set before is kept after src (a sitecustomize.py there can, e.g., point sysconfig at another stdlib).
set -euo pipefail
out=$1; n=${2:-2}; pairs=${3:-"0,1 2,3 4,5 6,7 8,9 10,11 12,13 14,15"}
mkdir -p "$out"
export CUDA_VISIBLE_DEVICES= PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
lscpu | grep -E 'Model name|^CPU\(s\)|Socket|NUMA node' > "$out/lscpu.txt" || true
probe='from pathlib import Path; from draftline.sizing.demo import measure_speed; print(measure_speed(Path("src/draftline/demo/assets/tiny-target")))'
for p in $pairs; do
  printf '%s %s\n' "$(taskset -c "$p" python3 -c "$probe" 2>/dev/null | tail -1)" "$p"
done | sort -n > "$out/probes.txt"
cat "$out/probes.txt"
since=$(( $(date +%s) - 150 ))
i=0
while read -r _ p && [ "$i" -lt "$n" ]; do
  taskset -c "$p" python3 -m draftline demo --minutes 9.5 --since "$since" --out "/tmp/demo$i" > "$out/demo$i.log" 2>&1 &
  i=$((i + 1))
done < "$out/probes.txt"
wait
for j in $(seq 0 $((i - 1))); do cp "/tmp/demo$j/demo.json" "$out/demo$j.json" 2>/dev/null || true; done
