#!/usr/bin/env bash
# A node daemon across jobs (issue 52; docs/validation.md): `attach --all --follow
# --metrics` left on the GPU host while GPT-2-shaped DDP jobs (tests/gpu/gpt2.py, world
# size 1, no launcher variables) come and go: A (300 steps), then B (600 steps), and C
# (300 steps) started while B runs. steps.json `jobs` and /metrics, scraped after the
# last job, against each job's own clock (its steps, their median and mean).
# usage: tests/gpu/jobs.sh NCCLTRACE_BINARY
set -uo pipefail
BIN=${1:?usage: jobs.sh NCCLTRACE_BINARY}
OUT=${OUT:-./gpu-out}/jobs
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
rm -rf "$OUT"; mkdir -p "$OUT"
"$BIN" attach --all --follow --duration 300s --metrics 127.0.0.1:9464 --out "$OUT/agent" \
  --force > "$OUT/stdout.txt" 2> "$OUT/stderr.txt" &
agent=$!
sleep 3
# start NAME STEPS: the job, waiting for NAME.go once warm; its pid in `job`.
start() {
  mkdir -p "$OUT/$1.pids"
  "$PY" "$HERE/gpt2.py" --steps "$2" --go-file "$OUT/$1.go" --pid-dir "$OUT/$1.pids" \
    > "$OUT/$1.json" 2> "$OUT/$1.err" &
  job=$!
  for _ in $(seq 1200); do grep -q ready "$OUT/$1.json" 2>/dev/null && break; sleep 0.1; done
  sleep 2
  touch "$OUT/$1.go"
}
start a 300; a=$job; wait "$a"; echo "A exit $?"
start b 600; b=$job
sleep 3
start c 300; c=$job
wait "$b"; echo "B exit $?"
wait "$c"; echo "C exit $?"
sleep 6
"$PY" -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode())" \
  > "$OUT/scrape.txt"
kill -INT "$agent"; wait "$agent"; echo "agent exit $?"
grep -E "attached to pid|error" "$OUT/stderr.txt" | head
"$PY" - "$OUT" <<'PY'
import json, re, statistics, sys
out = sys.argv[1]
st = json.load(open(f"{out}/agent/steps.json"))
scrape = open(f"{out}/scrape.txt").read()
def series(name):
    got = {}
    for m in re.finditer(rf'^{name}\{{([^}}]*)\}} (\S+)$', scrape, re.M):
        labels = dict(re.findall(r'([a-z_]+)="([^"]*)"', m.group(1)))
        got[labels.get("job_id", "")] = got.get(labels.get("job_id", ""), 0) + float(m.group(2))
    return got
count, total = series("nccltrace_step_seconds_count"), series("nccltrace_step_seconds_sum")
print("metrics step series by job_id:", {k: (v, round(total.get(k, 0) / max(v, 1) * 1e3, 2)) for k, v in count.items()})
for j in st["jobs"]:
    steps = st["steps"][j["first_step"]:j["first_step"] + j["steps"]]
    walls = [s["wall_ns"] / 1e6 for s in steps]
    print(json.dumps({k: j[k] for k in ("rank_pid", "job", "method", "period", "steps", "steps_left_out", "exited_ns")}))
    if walls:
        print(f"  ours: median {statistics.median(walls):.2f} ms, mean {statistics.mean(walls):.2f} ms")
for name in "abc":
    try:
        own = json.loads(open(f"{out}/{name}.json").read().splitlines()[-1])
    except Exception as e:
        print(name, "no output", e); continue
    pid = json.loads(open(f"{out}/{name}.json").read().splitlines()[0]).get("pid")
    print(f"job {name.upper()} pid {pid}: {own['steps']} steps, median {own['step_ms_median']:.2f} ms, mean {own['step_ms_mean']:.2f} ms, {own['allreduce_calls']} all-reduces")
s = json.load(open(f"{out}/agent/summary.json"))
print("ranks:", [(r["pid"], r["rank"], r["nccl"]["collectives"]) for r in s["ranks"]])
print("agent cost:", {k: s["agent"]["bpf"].get(k) for k in ("traced_total_step_share", "in_steps_step_share", "in_steps_per_step_ns", "outside_steps_ns")} if s["agent"]["bpf"] else s["agent"]["bpf_unmeasured"])
PY
