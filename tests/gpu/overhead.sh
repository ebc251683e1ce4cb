#!/usr/bin/env bash
# Traced / untraced step time of the PyTorch DDP job on a GPU host, for each profile given
# (a shipped name or a TOML file), runs interleaved: untraced, then traced, ROUNDS times.
# usage: tests/gpu/overhead.sh NCCLTRACE_BINARY STEPS ROUNDS PROFILE...
# Prints one line per run and, per profile, the median traced/untraced ratio of step means.
set -uo pipefail
BIN=${1:?usage: overhead.sh NCCLTRACE_BINARY STEPS ROUNDS PROFILE...}
STEPS=${2:?steps}
ROUNDS=${3:?rounds}
shift 3
OUT=${OUT:-./gpu-out}/overhead
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
mkdir -p "$OUT"
for round in $(seq "$ROUNDS"); do
  for profile in "$@"; do
    name=$(basename "$profile" .toml)
    "$PY" "$HERE/train.py" --mode ddp --steps "$STEPS" > "$OUT/$round-$name-untraced.json" 2>/dev/null
    traced "$OUT/$round-$name" "$OUT/$round-$name-out" --profile "$profile" -- \
      "$PY" "$HERE/train.py" --mode ddp --steps "$STEPS"
  done
done
"$PY" - "$OUT" "$ROUNDS" "$@" <<'PY'
import json, os, statistics, sys
out, rounds, profiles = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def step(path):
    for line in open(path):
        if '"step_ms_mean"' in line:
            return json.loads(line)["step_ms_mean"]
    return None
for p in profiles:
    name = os.path.basename(p).removesuffix(".toml")
    ratios = []
    for r in range(1, rounds + 1):
        u, t = step(f"{out}/{r}-{name}-untraced.json"), step(f"{out}/{r}-{name}-traced.json")
        print(f"{name} round {r}: untraced {u} ms, traced {t} ms")
        if u and t:
            ratios.append(t / u)
    if ratios:
        print(f"{name}: traced/untraced median {statistics.median(ratios):.4f} "
              f"({min(ratios):.4f}-{max(ratios):.4f}, {len(ratios)} pairs)")
PY
