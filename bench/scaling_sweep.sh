#!/usr/bin/env bash
# What the demo's tau would gain from more data and more training, and from objective variants at the
# demo's steps: the README's "What limits the demo's tau" table.
#   bash bench/scaling_sweep.sh OUT_DIR        (prints the table and writes OUT_DIR/table.md)
# On the 16-core H200 machine (training on its GPU, measuring on the CPU) it ran in 318 s: the demo's
# data made twice (640 and 1280 conversations, regenerated on the GPU, 81 s), then 15 processes
# (5 groups x seeds 0, 1, 2) of bench/objective_sweep.py, one CPU thread each.
set -u
OUT=${1:?usage: scaling_sweep.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD/src} OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
D=${DEMO_DATA:-/tmp/draftline-scaling}
mk() {
  [ -f "$D/c$1/data/meta.json" ] && return
  mkdir -p "$D/c$1"
  python -c "from pathlib import Path; from draftline.demo.pipeline import DemoConfig, Stages, make_data; \
make_data(DemoConfig(out=Path('$D/c$1'), conversations=$1), Path('$D/c$1'), Stages())" > "$OUT/data$1.log" 2>&1
}
t0=$(date +%s); mk 640 & mk 1280 & wait; echo "data ready after $(( $(date +%s) - t0 )) s"
run() {  # conversations seed variants epochs name
  timeout ${LIMIT:-440} python bench/objective_sweep.py --data "$D/c$1/data" --seed "$2" --variants "$3" \
    --epochs "$4" --out "$OUT/$5-s$2.json" > "$OUT/log-$5-s$2.txt" 2>&1
}
for s in ${SEEDS:-0 1 2}; do
  run 640 "$s" ours,chained16,gamma2 5 c640-e5a &
  run 640 "$s" chained,distill 5 c640-e5b &
  run 640 "$s" ours 10 c640-e10 &
  run 1280 "$s" ours 5 c1280-e5 &
  run 1280 "$s" ours 8 c1280-e8 &
done
wait
echo "sweep done after $(( $(date +%s) - t0 )) s"
python - "$OUT" <<'PY'
import collections, glob, json, sys
out = sys.argv[1]
rows = collections.defaultdict(list)
for path in sorted(glob.glob(f"{out}/c*-s*.json")):
    data = path.rsplit("/", 1)[1].split("-")
    for r in json.load(open(path)):
        rows[(data[0][1:], data[1].rstrip("ab")[1:], r["variant"])].append(r)
lines = ["| conversations | epochs | variant | steps | tau, seeds 0, 1, 2 | mean | spread | monitor 4x32 / tau | P(slot 1..4), mean |",
         "|---|---|---|---|---|---|---|---|---|"]
for (conv, epochs, variant), rs in sorted(rows.items(), key=lambda kv: (int(kv[0][0]), int(kv[0][1]), kv[0][2])):
    rs.sort(key=lambda r: r["seed"])
    taus = [r["tau"] for r in rs]
    p = [sum(r["p"][k] for r in rs) / len(rs) for k in range(4)]
    lines.append(f"| {conv} | {epochs} | {variant} | {rs[0]['steps']} | {', '.join(f'{t:.3f}' for t in taus)} | "
                 f"{sum(taus) / len(taus):.3f} | {max(taus) - min(taus):.3f} | "
                 + ", ".join(f"{r['monitor_tau'] / r['tau']:.2f}" for r in rs) + " | "
                 + ", ".join(f"{x:.2f}" for x in p) + " |")
text = "\n".join(lines)
print(text)
open(f"{out}/table.md", "w").write(text + "\n")
PY
for f in "$OUT"/log-*.txt; do grep -q '^{' "$f" || { echo "== $f (no result)"; tail -3 "$f"; }; done
