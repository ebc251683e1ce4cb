#!/usr/bin/env bash
# The run attributed while it is traced, on a real PyTorch rank (issue 18;
# docs/validation.md): steps.json grows during the run, the agent's whole-process peak
# memory, and the same steps from the recording attributed as one epoch by `report`.
# usage: tests/gpu/stream.sh NCCLTRACE_BINARY [SECONDS]
set -uo pipefail
BIN=${1:?usage: stream.sh NCCLTRACE_BINARY [SECONDS]}
SECS=${2:-30}
OUT=${OUT:-./gpu-out}/stream
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
rm -rf "$OUT"; mkdir -p "$OUT"
running_ddp "$OUT"
"$BIN" attach --pid "$train" --duration "${SECS}s" --out "$OUT/live" > "$OUT/live.txt" 2> "$OUT/live.err" &
agent=$!
sleep $((SECS / 2))
echo "steps in steps.json after $((SECS / 2)) s of a ${SECS} s run: $(grep -c '^    {"index"' "$OUT/live/steps.json")"
wait "$agent"; echo "agent exit $?"
kill "$train"; wait "$train" 2>/dev/null
tail -3 "$OUT/live.err"
"$BIN" report "$OUT/live/recording.nctr" --out "$OUT/whole" --epoch-events 0 > "$OUT/whole.txt" 2> "$OUT/whole.err"
echo "report exit $?"
"$PY" - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
live, whole = (json.load(open(f"{d}/{k}/steps.json")) for k in ("live", "whole"))
s = json.load(open(f"{d}/live/summary.json"))
a, b = live["steps"], whole["steps"]
same = sum(1 for x, y in zip(a, b) if x == y)
print(json.dumps({"events": s["events"], "lost": s["lost_events"], "peak_rss_mb": round(s["agent"]["peak_rss_kb"] / 1024, 1),
  "epochs_live": live["epochs"], "late_events_left_out": live["late_events_left_out"],
  "steps_live": len(a), "steps_whole": len(b), "steps_identical": same,
  "threads_identical": live["threads"] == whole["threads"], "ranks_identical": live["ranks"] == whole["ranks"],
  "first_difference": next(({"index": x["index"], "live": x["categories_ns"], "whole": y["categories_ns"]}
                              for x, y in zip(a, b) if x != y), None)}))
PY
