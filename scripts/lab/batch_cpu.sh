#!/usr/bin/env bash
# Batched decode on this machine's CPU, each side alone in its own process, alternating (the other core idle):
# muser_ti/bench/batch_decode.py --side engine / peer (torch) / ggml (llama.cpp's kernel on ggml built natively:
# python -m muser_ti.bench.native_ggml builds it once), ROUNDS rounds per (batch, depth); JSON rows to $OUT.
# LAUNCH: the engine's launch path (auto, capi, python).
set -euo pipefail
OUT=${OUT:-out/lab/batch_cpu}; mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
SIDES=${SIDES:-engine peer ggml}
NATIVE=""
if [[ " $SIDES " == *" ggml "* ]]; then
  NATIVE=$($PY -c "from muser_ti.bench.native_ggml import built; d = built(); print(d / 'py' if d else '')")
  [ -n "$NATIVE" ] || { echo "no native ggml: run $PY -m muser_ti.bench.native_ggml first" >&2; exit 1; }
fi
for depth in ${DEPTHS:-2048 32768}; do
  for batch in ${BATCHES:-1 8}; do
    for round in $(seq 1 "${ROUNDS:-3}"); do
      for side in $SIDES; do
        extra=""; [ "$side" = ggml ] && extra="$NATIVE"
        PYTHONPATH="$extra${extra:+:}${PYTHONPATH:-}" $PY -m muser_ti.bench.batch_decode --arch cpu --batch "$batch" \
          --depth "$depth" --tokens "${TOKENS:-10}" --side "$side" --launch "${LAUNCH:-auto}" --json \
          > "$OUT/b${batch}_d${depth}_r${round}_${side}.json"
      done
    done
    $PY - "$OUT" "$batch" "$depth" $SIDES <<'PY'
import glob, json, statistics, sys
out, batch, depth, *sides = sys.argv[1:]
med = {}
for side in sides:
    rows = [json.load(open(f))["rows"][0] for f in sorted(glob.glob(f"{out}/b{batch}_d{depth}_r*_{side}.json"))]
    vals = [r[f"{side}_ms"] for r in rows]
    med[side] = statistics.median(vals)
    note = f" (ggml native: {rows[0]['ggml']['native']})" if side == "ggml" else ""
    print(f"batch {batch:>3} depth {depth:>6} {side:>6}: " + " ".join(f"{v:.2f}" for v in vals)
          + f"  median {med[side]:.2f} ms{note}")
for peer in ("peer", "ggml"):
    if "engine" in med and peer in med:
        print(f"batch {batch:>3} depth {depth:>6}  engine / {peer} {med['engine'] / med[peer]:.2f}")
PY
  done
done
