#!/usr/bin/env bash
# Batched decode on this machine's CPU, each side alone in its own process, alternating (the other core idle):
# muser_ti/bench/batch_decode.py --side engine / --side peer, ROUNDS rounds per (batch, depth); JSON rows to $OUT.
set -euo pipefail
OUT=${OUT:-out/lab/batch_cpu}; mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
for depth in ${DEPTHS:-2048 32768}; do
  for batch in ${BATCHES:-1 8}; do
    for round in $(seq 1 "${ROUNDS:-3}"); do
      for side in engine peer; do
        $PY -m muser_ti.bench.batch_decode --arch cpu --batch "$batch" --depth "$depth" --tokens "${TOKENS:-10}" \
          --side "$side" --json > "$OUT/b${batch}_d${depth}_r${round}_${side}.json"
      done
    done
    $PY - "$OUT" "$batch" "$depth" <<'PY'
import glob, json, statistics, sys
out, batch, depth = sys.argv[1:]
med = {}
for side in ("engine", "peer"):
    vals = [json.load(open(f))["rows"][0][f"{side}_ms"] for f in sorted(glob.glob(f"{out}/b{batch}_d{depth}_r*_{side}.json"))]
    med[side] = statistics.median(vals)
    print(f"batch {batch:>3} depth {depth:>6} {side:>6}: " + " ".join(f"{v:.2f}" for v in vals) + f"  median {med[side]:.2f} ms")
print(f"batch {batch:>3} depth {depth:>6}  ratio {med['engine'] / med['peer']:.2f}")
PY
  done
done
