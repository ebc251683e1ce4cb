#!/usr/bin/env bash
# Issue 59 on a real PyTorch rank: the agent never turns the kernel's run-time accounting
# of BPF programs on, and its programs' own accounting (summary.json agent.bpf) gives the
# figures. The DDP job already running, traced for SECONDS by each binary given, one after
# another in the same process, while this script reads the kernel's run counts of the
# agent's programs (/proc/AGENT/fdinfo of its BPF program descriptors) every 20 ms: the
# kernel counts runs only while its accounting is on, so any count above 0 means it was.
# usage: tests/gpu/accounting.sh SECONDS NCCLTRACE_BINARY...
set -uo pipefail
SECS=${1:?usage: accounting.sh SECONDS NCCLTRACE_BINARY...}
shift
OUT=${OUT:-./gpu-out}/accounting
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
rm -rf "$OUT"; mkdir -p "$OUT"
echo "kernel.bpf_stats_enabled before: $(cat /proc/sys/kernel/bpf_stats_enabled)"
running_ddp "$OUT"
i=0
for BIN in "$@"; do
  i=$((i + 1))
  "$BIN" attach --pid "$train" --duration "${SECS}s" --out "$OUT/run$i" \
    > "$OUT/run$i.txt" 2> "$OUT/run$i.err" &
  agent=$!
  "$PY" - "$agent" > "$OUT/run$i-kernel-counts.json" <<'PY'
import json, os, sys, time
pid = int(sys.argv[1])
readings, most, progs = 0, 0, 0
while os.path.exists(f"/proc/{pid}/fdinfo"):
    total, n = 0, 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fdinfo"):
            try:
                info = open(f"/proc/{pid}/fdinfo/{fd}").read()
            except OSError:
                continue
            if "prog_id:" in info and "run_cnt:" in info:
                n += 1
                total += int(info.split("run_cnt:")[1].split()[0])
    except OSError:
        break
    if n:
        readings += 1
        most, progs = max(most, total), max(progs, n)
    time.sleep(0.02)
print(json.dumps({"readings": readings, "program_fds": progs, "max_kernel_run_cnt": most}))
PY
  wait "$agent"; echo "run$i ($BIN): exit $?; $(cat "$OUT/run$i-kernel-counts.json"); $(grep '^agent cost' "$OUT/run$i.txt")"
done
kill "$train"; wait "$train" 2>/dev/null
echo "kernel.bpf_stats_enabled after: $(cat /proc/sys/kernel/bpf_stats_enabled)"
"$PY" - "$OUT" "$#" <<'PY'
import json, sys
out, n = sys.argv[1], int(sys.argv[2])
for i in range(1, n + 1):
    s = json.load(open(f"{out}/run{i}/summary.json"))
    steps = json.load(open(f"{out}/run{i}/steps.json"))["steps"]
    bpf = s["agent"]["bpf"] or {}
    walls = sorted(x["wall_ns"] for x in steps)
    print(json.dumps({"run": i, "steps": len(steps),
        "median_step_ms": walls[len(walls) // 2] / 1e6 if walls else None,
        "lost": s["lost_events"], "bpf_unmeasured": s["agent"].get("bpf_unmeasured"),
        "accounted_share": bpf.get("accounted_share"),
        "traced_total_per_step_us": (bpf.get("traced_total_per_step_ns") or 0) / 1e3,
        "traced_programs_per_step_us": (bpf.get("traced_per_step_ns") or 0) / 1e3,
        "all_cpus_per_step_us": (bpf.get("per_step_ns") or 0) / 1e3,
        "programs": {p["name"]: [p["runs"], p["ns_per_run"]] for p in bpf.get("programs", [])}}))
PY
