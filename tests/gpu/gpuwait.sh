#!/usr/bin/env bash
# The host's wait for the GPU against the job's own CUPTI timeline (issue 51;
# docs/validation.md): the DDP and hand-all-reduce ranks of train.py, world size 1, their
# communicator made before the agent attaches (as `attach --pid` finds real jobs). Each
# mode runs twice: traced by nccltrace, and alone under torch.profiler (the truth: NCCL
# kernels' GPU time, the host's time in CUDA syncs, per step). The DDP rank pauses 1.5 s
# before its loop: steps.json idle against the script's own pause. Every output under $OUT
# (default ./gpu-out).
# usage: tests/gpu/gpuwait.sh NCCLTRACE_BINARY
set -uo pipefail
BIN=${1:?usage: gpuwait.sh NCCLTRACE_BINARY}
OUT=${OUT:-./gpu-out}/gpuwait
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
rm -rf "$OUT"; mkdir -p "$OUT"
for mode in ddp allreduce; do
  echo "== $mode: traced"
  # The DDP rank sleeps 1.5 s before its loop: idle, not steps.
  pause=0; [ "$mode" = ddp ] && pause=1500
  traced "$OUT/$mode" "$OUT/$mode-agent" -- "$PY" "$HERE/train.py" --mode "$mode" --steps 800 --pause-ms "$pause"
  tail -2 "$OUT/$mode-stderr.txt"
  echo "== $mode: under torch.profiler, not traced"
  "$PY" "$HERE/train.py" --mode "$mode" --steps 100 --cupti 200 > "$OUT/$mode-cupti.json" 2> "$OUT/$mode-cupti.err"
  echo "exit $?"
  "$PY" - "$OUT" "$mode" <<'PY'
import json, statistics, sys
out, mode = sys.argv[1:]
agent = f"{out}/{mode}-agent"
st = json.load(open(f"{agent}/steps.json"))
steps = st["steps"]
med = lambda k: statistics.median(s["categories_ns"][k] or 0 for s in steps) / 1e6
share = lambda k: sum(s["categories_ns"][k] or 0 for s in steps) / sum(s["wall_ns"] for s in steps)
job = json.loads(open(f"{out}/{mode}-traced.json").read().splitlines()[-1])
truth = json.loads(open(f"{out}/{mode}-cupti.json").read().splitlines()[-1])["cupti"]
stdout = open(f"{out}/{mode}-stdout.txt").read()
verdict = [l for l in stdout.splitlines() if "of step time" in l]
print(json.dumps({
  "mode": mode,
  "communicators": st["communicators"],
  "steps": len(steps), "job_steps": job["steps"],
  "job_pause_ms": job["pause"]["ms"],
  "idle": [{"when": i["when"], "ms": round(i["wall_ns"] / 1e6, 1),
            "top": max(i["categories_ns"], key=lambda k: i["categories_ns"][k] or 0)} for i in st["idle"]],
  "steps_over_1s": sum(1 for s in steps if s["wall_ns"] > 1e9),
  "job_step_ms_median": job["step_ms_median"],
  "agent_ms_per_step_median": {
      "wall": round(statistics.median(s["wall_ns"] for s in steps) / 1e6, 3),
      "compute": round(med("compute"), 3), "gpu_wait": round(med("gpu_wait"), 3),
      "nccl_wait": round(med("nccl_wait"), 3)},
  "agent_share": {k: round(share(k), 4) for k in ["compute", "gpu_wait", "nccl_wait", "runqueue", "other_offcpu"]},
  "steps_with_nccl_wait": sum(1 for s in steps if s["categories_ns"]["nccl_wait"]),
  "cupti": truth,
  "verdict": verdict,
  "waits_on_nccl_said": "waits on NCCL" in stdout,
  "gpu_line": [l for l in stdout.splitlines() if l.startswith("GPU ")],
  "gpu_busy_step_median": statistics.median(s["gpu"][0]["busy"] for s in steps if s.get("gpu")) if any(s.get("gpu") for s in steps) else None,
  "cupti_busy_share": round(truth["gpu_busy_ms_per_step"] / truth["wall_ms_per_step"], 3) if truth and truth.get("wall_ms_per_step") else None,
}, indent=1))
PY
done
echo "== sweep: 4 one-rank DDP jobs on the one GPU, attach --all"
go="$OUT/sweep.go"; rm -f "$go"; pids=()
for i in 1 2 3 4; do
  "$PY" "$HERE/train.py" --mode ddp --steps 300 --go-file "$go" > "$OUT/sweep-$i.json" 2> "$OUT/sweep-$i.err" &
  pids+=($!)
done
for i in 1 2 3 4; do
  for _ in $(seq 900); do grep -q ready "$OUT/sweep-$i.json" 2>/dev/null && break; sleep 0.1; done
done
"$BIN" attach --all --out "$OUT/sweep-agent" --force > "$OUT/sweep-stdout.txt" 2> "$OUT/sweep-stderr.txt" &
agent=$!
for _ in $(seq 600); do [ "$(grep -c "attached to pid" "$OUT/sweep-stderr.txt" 2>/dev/null)" -ge 4 ] && break; sleep 0.1; done
touch "$go"
for p in "${pids[@]}"; do wait "$p"; done
wait "$agent"; echo "agent exit $?"
"$PY" - "$OUT" "${pids[@]}" <<'PY'
import json, sys
out, pids = sys.argv[1], [int(p) for p in sys.argv[2:]]
s = json.load(open(f"{out}/sweep-agent/summary.json"))
st = json.load(open(f"{out}/sweep-agent/steps.json"))
jobs = {}
for i, pid in enumerate(pids, 1):
    jobs[pid] = json.loads(open(f"{out}/sweep-{i}.json").read().splitlines()[-1])
stdout = open(f"{out}/sweep-stdout.txt").read()
print(json.dumps({
  "straggler": s.get("straggler"), "stragglers_by_job": s.get("stragglers_by_job"),
  "one_rank_jobs": sorted(st.get("one_rank_jobs", [])), "pids": sorted(pids),
  "ranks": [{"pid": r["pid"], "rank": r["rank"], "rank_source": r["rank_source"],
             "collectives": r["nccl"]["collectives"],
             "job_allreduce_calls": jobs.get(r["pid"], {}).get("allreduce_calls")} for r in s["ranks"]],
  "communicators": st["communicators"],
  "straggler_lines": [l for l in stdout.splitlines() if "straggler" in l or "of step time" in l],
}, indent=1))
PY
echo "== done"
