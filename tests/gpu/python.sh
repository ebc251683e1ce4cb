#!/usr/bin/env bash
# Python frames on the GPU host (docs/validation.md): the DDP script launched with
# PYTHONPERFSUPPORT=1 (Python 3.12's perf trampolines name each Python function in
# /tmp/perf-PID.map), traced by nccltrace; how many flamegraph stacks name Python functions.
# usage: tests/gpu/python.sh NCCLTRACE_BINARY [STEPS]   (outputs under $OUT/python)
set -uo pipefail
BIN=${1:?usage: python.sh NCCLTRACE_BINARY [STEPS]}
STEPS=${2:-100}
OUT=${OUT:-./gpu-out}/python
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
mkdir -p "$OUT"
"$PY" -c 'import sys, sysconfig; print(sys.version.split()[0], sysconfig.get_config_var("CFLAGS"))' > "$OUT/python.txt" 2>&1
traced "$OUT/ddp" "$OUT/ddp" -- env PYTHONPERFSUPPORT=1 "$PY" "$HERE/train.py" --mode ddp --steps "$STEPS"
echo "== python: $(cat "$OUT/python.txt")"
tail -2 "$OUT/ddp-stderr.txt"
for f in oncpu nccl-wait offcpu attributed; do
  folded="$OUT/ddp/flamegraph-$f.folded"
  echo "$f: $(grep -c 'py::' "$folded") of $(wc -l < "$folded") stacks name Python functions"
done
echo "== heaviest nccl-wait stacks, Python and call-site frames only"
sort -t' ' -k2 -nr "$OUT/ddp/flamegraph-nccl-wait.folded" | head -3 \
  | tr ';' '\n' | grep -E '^py::|^\[in |^[0-9]+$| [0-9]+$|Synchronize' | head -40
