#!/usr/bin/env bash
# The GPT-2-shaped DDP job (tests/gpu/gpt2.py: 12 layers, bf16 autocast, AdamW, a
# DataLoader of 4 workers with pinned memory, world size 1) traced with `attach --all`, as
# a user finds it: the rank and its workers. The script sleeps 1.5 s before its loop. Then
# the same script alone under torch.profiler (the truth: NCCL kernels' GPU time and the
# host's time in CUDA syncs, per step). Checks what the agent says against the script's own
# figures: one rank, its workers by pid, the pause as idle, no steps over 1 s, the
# collectives counted. Every output under $OUT (default ./gpu-out).
# BATCH (default 16) sets the batch: 64 makes the GPU's work per step four times longer for
# the same launches (a GPU-bound step, its launch queue full).
# usage: tests/gpu/gpt2.sh NCCLTRACE_BINARY
set -uo pipefail
BIN=${1:?usage: gpt2.sh NCCLTRACE_BINARY}
OUT=${OUT:-./gpu-out}/gpt2
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
rm -rf "$OUT"; mkdir -p "$OUT/pids"
go="$OUT/go"
echo "== traced: attach --all"
BATCH=${BATCH:-16}
"$PY" "$HERE/gpt2.py" --batch "$BATCH" --steps 200 --pause-ms 1500 --go-file "$go" --pid-dir "$OUT/pids" \
  > "$OUT/traced.json" 2> "$OUT/traced.err" &
job=$!
for _ in $(seq 1200); do grep -q ready "$OUT/traced.json" 2>/dev/null && break; sleep 0.1; done
"$BIN" attach --all --out "$OUT/agent" --force > "$OUT/stdout.txt" 2> "$OUT/stderr.txt" &
agent=$!
for _ in $(seq 600); do
  n=$(sed -n 's/.*--all found \([0-9]*\) process.*/\1/p' "$OUT/stderr.txt" 2>/dev/null)
  [ -n "$n" ] && [ "$(grep -c "attached to pid" "$OUT/stderr.txt")" -ge "$n" ] && break
  sleep 0.1
done
touch "$go"
wait "$job"; echo "job exit $?"
wait "$agent"; echo "agent exit $?"
head -3 "$OUT/stderr.txt"; tail -2 "$OUT/stderr.txt"
echo "== under torch.profiler, not traced"
"$PY" "$HERE/gpt2.py" --batch "$BATCH" --steps 20 --cupti 50 > "$OUT/cupti.json" 2> "$OUT/cupti.err"
echo "exit $?"
sed -n '/^Steps:/,$p' "$OUT/stdout.txt"
"$PY" - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
st = json.load(open(f"{out}/agent/steps.json"))
s = json.load(open(f"{out}/agent/summary.json"))
job = json.loads(open(f"{out}/traced.json").read().splitlines()[-1])
truth = json.loads(open(f"{out}/cupti.json").read().splitlines()[-1])["cupti"]
steps = st["steps"]
med = lambda k: round(statistics.median(x["categories_ns"][k] or 0 for x in steps) / 1e6, 3)


def launch_ms(out, n):
    """On-CPU time per step in kernel launches (a cu*Launch* frame on the stack), by the
    rank's threads, from the agent's samples (weights in µs)."""
    per = {}
    for line in open(f"{out}/agent/flamegraph-oncpu.folded"):
        stack, w = line.rsplit(" ", 1)
        thread = stack.split(";", 1)[0]
        if "(main (rank))" in thread or "(autograd)" in thread:
            key = thread.split(" (")[0]
            tot, launch = per.get(key, (0, 0))
            per[key] = (tot + int(w), launch + int(w) * ("LaunchKernel" in stack))
    return {k: {"on_cpu_ms": round(t / 1e3 / n, 2), "launch_ms": round(l / 1e3 / n, 2)}
            for k, (t, l) in per.items()}

p0 = job["pause"]["start_ns"]; p1 = p0 + job["pause"]["ms"] * 1e6
print(json.dumps({
  "job": {k: job[k] for k in ["steps", "allreduce_calls", "step_ms_median", "backward_ms_median",
                                "item_ms_median", "workers", "pause"]},
  "launch_in_samples_ms_per_step": launch_ms(out, job["steps"]),
  "cupti": truth,
  "ranks": [{k: r[k] for k in ["pid", "rank", "rank_source"]} | {"collectives": r["nccl"]["collectives"]} for r in s["ranks"]],
  "workers": [{k: w[k] for k in ["pid", "rank_pid", "parent_pid", "threads", "faults"]}
              | {"compute_ms": round(w["categories_ns"]["compute"] / 1e6, 1)} for w in s.get("workers", [])],
  "workers_match": sorted(w["pid"] for w in s.get("workers", [])) == job["workers"],
  "rank_tid": st["rank_tid"],
  "steps": len(steps), "steps_over_1s": sum(1 for x in steps if x["wall_ns"] > 1e9),
  "agent_step_ms_median": round(statistics.median(x["wall_ns"] for x in steps) / 1e6, 3),
  "agent_ms_per_step_median": {k: med(k) for k in ["compute", "gpu_wait", "nccl_wait", "runqueue", "other_offcpu"]},
  "gpu_wait_error_ms_median": round(statistics.median(x.get("gpu_wait_error_ns") or 0 for x in steps) / 1e6, 3),
  "gpu_wait_method": st["methods"]["gpu_wait"][-420:],
  "idle": [{"when": i["when"], "ms": round(i["wall_ns"] / 1e6, 1),
            "from_pause_start_ms": round((i["start_ns"] - p0) / 1e6, 1),
            "to_pause_end_ms": round((i["end_ns"] - p1) / 1e6, 1)} for i in st["idle"]],
  "communicators": st["communicators"],
}, indent=1))
PY
echo "== done"
