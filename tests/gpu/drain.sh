#!/bin/bash
# Drain rate on a many-core host: P processes each call ncclAllReduce N times (NULL
# communicator: it returns at once) into the real libnccl, all traced by one agent
# (--profile minimal), released together. Prints the events drained per second while the
# callers ran, the events lost, and the agent's CPU over that time.
# usage: drain.sh BIN FIXTURES LIBNCCL [P] [N]   (outputs under $OUT, default /tmp/drain)
set -u
BIN=$1 F=$2 LIB=$3 P=${4:-8} N=${5:-1000000}
OUT=${OUT:-/tmp/drain}
rm -rf "$OUT" && mkdir -p "$OUT"
go=$OUT/go
pids=()
for i in $(seq "$P"); do
  "$F/nccl_caller" "$LIB" "$N" "$go" > "$OUT/caller$i.json" &
  pids+=($!)
done
for i in $(seq "$P"); do
  for _ in $(seq 600); do grep -q ready "$OUT/caller$i.json" 2>/dev/null && break; sleep 0.1; done
done
list=$(IFS=,; echo "${pids[*]}")
"$BIN" attach --pid "$list" --profile minimal --out "$OUT/agent" --force \
  > "$OUT/agent-stdout.txt" 2> "$OUT/agent-stderr.txt" &
agent=$!
for _ in $(seq 600); do grep -q "attached to pid" "$OUT/agent-stderr.txt" 2>/dev/null && break; sleep 0.1; done
ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
c0=$(ticks "$agent"); t0=$(date +%s%N)
touch "$go"
for p in "${pids[@]}"; do wait "$p"; done
t1=$(date +%s%N); c1=$(ticks "$agent")
wait "$agent"; echo "agent exit $?" >> "$OUT/agent-stderr.txt"
python3 - "$OUT" "$P" "$N" "$t0" "$t1" "$c0" "$c1" "$(getconf CLK_TCK)" <<'PY'
import json, sys
out, p, n, t0, t1, c0, c1, hz = sys.argv[1:]
s = json.load(open(f"{out}/agent/summary.json"))
wall = (int(t1) - int(t0)) / 1e9
calls = s["nccl"]["calls"]
per_call = [json.loads(open(f"{out}/caller{i}.json").read().splitlines()[-1])["ns_per_call"]
            for i in range(1, int(p) + 1)]
print(json.dumps({
    "processes": int(p), "calls_each": int(n), "wall_s": round(wall, 3),
    "calls_recorded": calls, "events": s["events"], "lost_events": s["lost_events"],
    "drained_per_s": round(s["events"] / wall), "agent_cpu_percent": round((int(c1) - int(c0)) / int(hz) / wall * 100, 1),
    "caller_ns_per_call": [round(x) for x in per_call],
    "agent_peak_rss_kb": s["agent"]["peak_rss_kb"],
}))
PY
