#!/usr/bin/env bash
# The agent's own cost on a real PyTorch rank (issue 22), as the kernel accounts the
# programs' run time (summary.json agent.bpf): the DDP job already running, traced for
# SECONDS with each profile given, one after another in the same process.
# usage: tests/gpu/cost.sh NCCLTRACE_BINARY [SECONDS] [PROFILE...]   (default: default minimal)
set -uo pipefail
BIN=${1:?usage: cost.sh NCCLTRACE_BINARY [SECONDS] [PROFILE...]}
SECS=${2:-10}
shift $(( $# >= 2 ? 2 : 1 ))
[ "$#" -gt 0 ] || set -- default minimal
OUT=${OUT:-./gpu-out}/cost
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
rm -rf "$OUT"; mkdir -p "$OUT"
running_ddp "$OUT"
for profile in "$@"; do
  name=$(basename "$profile" .toml)
  "$BIN" attach --pid "$train" --duration "${SECS}s" --profile "$profile" --out "$OUT/$name" \
    > "$OUT/$name.txt" 2> "$OUT/$name.err"
  echo "$name: exit $?; $(grep '^agent cost' "$OUT/$name.txt")"
done
kill "$train"; wait "$train" 2>/dev/null
"$PY" - "$OUT" "$@" <<'PY'
import json, os, sys
out, profiles = sys.argv[1], sys.argv[2:]
for p in profiles:
    name = os.path.basename(p).removesuffix(".toml")
    s = json.load(open(f"{out}/{name}/summary.json"))
    steps = json.load(open(f"{out}/{name}/steps.json"))["steps"]
    bpf = s["agent"]["bpf"] or {}
    walls = sorted(x["wall_ns"] for x in steps)
    print(json.dumps({"profile": name, "steps": len(steps),
        "median_step_ms": walls[len(walls) // 2] / 1e6 if walls else None,
        "lost": s["lost_events"], "bpf_unmeasured": s["agent"].get("bpf_unmeasured"),
        "traced_total_per_step_us": (bpf.get("traced_total_per_step_ns") or 0) / 1e3,
        "traced_total_step_share": bpf.get("traced_total_step_share"),
        "traced_programs_per_step_us": (bpf.get("traced_per_step_ns") or 0) / 1e3,
        "trap_ns_per_call": bpf.get("trap_ns_per_call"), "traps_per_step_us": (bpf.get("traps_per_step_ns") or 0) / 1e3,
        "all_cpus_per_step_us": (bpf.get("per_step_ns") or 0) / 1e3, "cpu_share": bpf.get("cpu_share"),
        "offcpu_stacks": s["offcpu_stacks"], "offcpu_stacks_taken": s.get("offcpu_stacks_taken"),
        "offcpu_short": [s["counters"].get("offcpu_stacks_skipped_short"),
                         s["counters"].get("offcpu_stacks_skipped_short_ns")],
        "programs": [(q["name"], q["runs"], q["traced_runs"], q["ns_per_run"], (q["traced_per_step_ns"] or 0) / 1e3)
                     for q in bpf.get("programs", [])]}))
PY
