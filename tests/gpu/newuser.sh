#!/usr/bin/env bash
# What a new user trips over, on a real PyTorch rank (issue 17; docs/validation.md): a
# wrapper's double SIGINT, a forced second Ctrl-C, attaching to a job already running, and
# the minimal profile's unmeasured categories. Every output under $OUT (default ./gpu-out).
# usage: tests/gpu/newuser.sh NCCLTRACE_BINARY
set -uo pipefail
BIN=${1:?usage: newuser.sh NCCLTRACE_BINARY}
OUT=${OUT:-./gpu-out}/newuser
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
rm -rf "$OUT"; mkdir -p "$OUT"
running_ddp "$OUT"
summary() { "$PY" - "$1" <<'PY'
import json, sys
d = sys.argv[1]
s = json.load(open(f"{d}/summary.json")); st = json.load(open(f"{d}/steps.json"))
steps = st["steps"]
bad = [x["index"] for x in steps if abs(sum(v or 0 for v in x["categories_ns"].values()) - x["wall_ns"]) > 1000]
print(json.dumps({"stop": s["stop_reason"], "incomplete": s["incomplete"], "collectives": s["nccl"]["collectives"],
  "calls": s["nccl"]["calls"], "steps": len(steps), "left_out": st["partial_steps_left_out"],
  "steps_not_adding_up": bad[:5], "nccl_wait": st["methods"]["nccl_wait"][:60],
  "page_fault": st["methods"]["page_fault"][:60],
  "first_step": steps[0]["categories_ns"] if steps else None}))
PY
}
echo "== wrapped: timeout -s INT 8 (one request, delivered twice)"
timeout -s INT 8 "$BIN" attach --pid "$train" --out "$OUT/wrapped" > "$OUT/wrapped.txt" 2> "$OUT/wrapped.err"
echo "exit $? (124 = timeout's own)"; ls "$OUT/wrapped"; summary "$OUT/wrapped"; tail -4 "$OUT/wrapped.err"
echo "== minimal profile"
"$BIN" attach --pid "$train" --profile minimal --duration 5s --out "$OUT/minimal" > "$OUT/minimal.txt" 2> "$OUT/minimal.err"
echo "exit $?"; summary "$OUT/minimal"; grep -E "nccl_wait|page_fault|unattributed|of step time" "$OUT/minimal.txt"
echo "== forced: a second SIGINT 1.2 s after the first"
"$BIN" attach --pid "$train" --out "$OUT/forced" > "$OUT/forced.txt" 2> "$OUT/forced.err" &
agent=$!
for _ in $(seq 600); do grep -q "attached to pid" "$OUT/forced.err" 2>/dev/null && break; sleep 0.1; done
sleep 5; kill -INT "$agent"
for _ in $(seq 600); do grep -q "tracing stopped" "$OUT/forced.err" 2>/dev/null && break; sleep 0.01; done
kill -STOP "$agent"; sleep 1.2; kill -INT "$agent"; kill -CONT "$agent"
wait "$agent"; echo "exit $?"; cat "$OUT/forced.err"
cmd=$(grep -E '^  nccltrace report ' "$OUT/forced.err" | sed 's/^  nccltrace //')
if [ -n "$cmd" ]; then
  # shellcheck disable=SC2086
  "$BIN" $cmd > /dev/null 2> "$OUT/forced-report.err"; echo "report exit $?"; summary "$OUT/forced"
fi
kill "$train"; wait "$train" 2>/dev/null
echo "== done"
