#!/usr/bin/env bash
# The host's wait for the GPU against the job's own CUPTI timeline (issue 51;
# docs/validation.md): the DDP and hand-all-reduce ranks of train.py, world size 1, their
# communicator made before the agent attaches (as `attach --pid` finds real jobs). Each
# mode runs twice: traced by nccltrace, and alone under torch.profiler (the truth: NCCL
# kernels' GPU time, the host's time in CUDA syncs, per step). Every output under $OUT
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
  traced "$OUT/$mode" "$OUT/$mode-agent" -- "$PY" "$HERE/train.py" --mode "$mode" --steps 800
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
  "steps": len(steps),
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
}, indent=1))
PY
done
echo "== done"
