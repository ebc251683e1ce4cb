#!/usr/bin/env bash
# Validation on a GPU machine (see docs/validation.md): each mode traced by nccltrace, then
# untraced (before and after), with every output under $OUT (default ./gpu-out).
# usage: tests/gpu/run.sh NCCLTRACE_BINARY [STEPS]
set -uo pipefail
BIN=${1:?usage: run.sh NCCLTRACE_BINARY [STEPS]}
STEPS=${2:-300}
OUT=${OUT:-./gpu-out}
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
uname -r >> "$OUT/gpu.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
for mode in ddp allreduce; do
  # Untraced before and after the traced run, so drift shows as a difference between them.
  "$PY" "$HERE/train.py" --mode "$mode" --steps "$STEPS" > "$OUT/$mode-untraced-before.json" 2> "$OUT/$mode-untraced-before.err"
  traced "$OUT/$mode" "$OUT/$mode" -- "$PY" "$HERE/train.py" --mode "$mode" --steps "$STEPS"
  "$PY" "$HERE/train.py" --mode "$mode" --steps "$STEPS" > "$OUT/$mode-untraced.json" 2> "$OUT/$mode-untraced.err"
  echo "== $mode"; cat "$OUT/$mode-untraced-before.json" "$OUT/$mode-traced.json" "$OUT/$mode-untraced.json"; tail -3 "$OUT/$mode-stderr.txt"
  cat "$OUT/$mode-stdout.txt"
done
