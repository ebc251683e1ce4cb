#!/usr/bin/env bash
# Python frames on the GPU host (docs/validation.md, issue 21): the DDP script started as
# it is, with no perf flag (no PYTHONPERFSUPPORT, no -X perf), traced by nccltrace; how
# many flamegraph stacks name Python frames, and how much of the NCCL wait is drawn under
# the training loop's line that calls `loss.item()`.
# usage: tests/gpu/python.sh NCCLTRACE_BINARY [STEPS]   (outputs under $OUT/python)
set -uo pipefail
BIN=${1:?usage: python.sh NCCLTRACE_BINARY [STEPS]}
STEPS=${2:-300}
OUT=${OUT:-./gpu-out}/python
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
mkdir -p "$OUT"
"$PY" -c 'import sys; print(sys.version.split()[0])' > "$OUT/python.txt" 2>&1
LINE=$(grep -n 'return loss.item()' "$HERE/train.py" | head -1 | cut -d: -f1)
traced "$OUT/ddp" "$OUT/ddp" -- "$PY" "$HERE/train.py" --mode ddp --steps "$STEPS"
echo "== python $(cat "$OUT/python.txt"); loss.item() is train.py:$LINE"
grep -A6 '"python"' "$OUT/ddp/summary.json"
tail -2 "$OUT/ddp-stderr.txt"
for f in oncpu nccl-wait offcpu attributed; do
  folded="$OUT/ddp/flamegraph-$f.folded"
  echo "$f: $(grep -cE '\.py:[0-9]+\)' "$folded") of $(wc -l < "$folded") stacks name Python frames"
done
echo "== share of the nccl-wait weight under 'step (train.py:$LINE)'"
awk -v want="step (train.py:$LINE)" '{ w = $NF; total += w; if (index($0, want)) under += w }
  END { if (total > 0) printf "%.1f%% of %d ns\n", 100 * under / total, total; else print "no wait" }' \
  "$OUT/ddp/flamegraph-nccl-wait.folded"
echo "== heaviest nccl-wait stacks, Python and call-site frames only"
sort -t' ' -k2 -nr "$OUT/ddp/flamegraph-nccl-wait.folded" | head -3 \
  | tr ';' '\n' | grep -E '\.py:[0-9]+\)|^\[in |Synchronize| [0-9]+$' | head -40
