#!/usr/bin/env bash
# The node daemon's pieces on a real PyTorch rank (issue 19; docs/validation.md): the
# agent joins a running DDP job with --metrics and --rotate, /metrics is scraped every 5 s
# while it runs, and the scrapes are compared with the windows' own steps.json.
# usage: tests/gpu/metrics.sh NCCLTRACE_BINARY [SECONDS]
set -uo pipefail
BIN=${1:?usage: metrics.sh NCCLTRACE_BINARY [SECONDS]}
SECS=${2:-40}
OUT=${OUT:-./gpu-out}/metrics
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
rm -rf "$OUT"; mkdir -p "$OUT"
# What a launcher would set: the labels come from the rank's environment.
export RANK=0 LOCAL_RANK=0 SLURM_JOB_ID=h200-check
running_ddp "$OUT"
"$BIN" attach --pid "$train" --duration "${SECS}s" --metrics 127.0.0.1:9464 --rotate 15s \
  --out "$OUT/live" > "$OUT/live.txt" 2> "$OUT/live.err" &
agent=$!
# The agent's memory every 50 ms: seconds since start, VmRSS, RssAnon, RssFile, VmHWM (kB).
( t0=$(date +%s.%N)
  while kill -0 "$agent" 2>/dev/null; do
    awk -v now="$(date +%s.%N)" -v t0="$t0" \
      '/^(VmRSS|RssAnon|RssFile|VmHWM):/ {v[$1]=$2} END {print now - t0, v["VmRSS:"], v["RssAnon:"], v["RssFile:"], v["VmHWM:"]}' \
      "/proc/$agent/status" 2>/dev/null
    sleep 0.05
  done > "$OUT/mem.txt" ) &
sleep 3
for i in $(seq 1 $(((SECS - 5) / 5))); do
  "$PY" -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode())" \
    > "$OUT/scrape-$i.txt" 2>> "$OUT/scrape.err"
  sleep 5
done
wait "$agent"; echo "agent exit $?"
kill "$train"; wait "$train" 2>/dev/null
grep -v "^nccltrace: warning" "$OUT/live.err" | tail -4
"$PY" - "$OUT" <<'PY'
import glob, json, os, re, sys
d = sys.argv[1]
def series(path, name, **labels):
    total = None
    for line in open(path):
        if line.startswith("#"): continue
        m = re.match(r'([a-z_]+)\{([^}]*)\} (\S+)', line)
        if not m or m.group(1) != name: continue
        got = dict(kv.split("=", 1) for kv in re.findall(r'[a-z_]+="[^"]*"', m.group(2)))
        if all(got.get(k) == f'"{v}"' for k, v in labels.items()):
            total = (total or 0) + float(m.group(3))
    return total
def memory(path):
    rows = [l.split() for l in open(path) if len(l.split()) == 5]
    rows = [[float(x) for x in r] for r in rows]
    if not rows: return None
    top = lambda i: max(rows, key=lambda r: r[i])
    mb = lambda kb: round(kb / 1024, 1)
    return {"samples": len(rows), "rss_max": mb(top(1)[1]), "rss_max_at_s": round(top(1)[0], 1),
            "anon_max": mb(top(2)[2]), "anon_max_at_s": round(top(2)[0], 1),
            "file_max": mb(top(3)[3]), "file_max_at_s": round(top(3)[0], 1),
            "vmhwm_last": mb(rows[-1][4]),
            "rss_by_5s": [mb(max(r[1] for r in rows if int(r[0] // 5) == b)) for b in sorted({int(r[0] // 5) for r in rows})]}
scrapes = sorted(glob.glob(f"{d}/scrape-*.txt"), key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0]))
counts = [series(p, "nccltrace_step_seconds_count", rank="0", local_rank="0", job_id="h200-check") for p in scrapes]
last = scrapes[-1]
windows = sorted(p for p in glob.glob(f"{d}/live/*/") if os.path.exists(p + "steps.json"))
steps = [json.load(open(w + "steps.json"))["steps"] for w in windows]
allsteps = [s for ws in steps for s in ws]
summaries = [json.load(open(w + "summary.json")) for w in windows]
cat = lambda c: series(last, "nccltrace_step_category_seconds_total", rank="0", category=c)
wall = series(last, "nccltrace_step_seconds_sum", rank="0")
print(json.dumps({
  "scrapes": len(scrapes), "step_count_by_scrape": counts,
  "windows": [os.path.basename(w.rstrip("/")) for w in windows],
  "steps_per_window": [len(s) for s in steps], "steps_in_windows": len(allsteps),
  "allreduce_per_window": [s["nccl"]["by_op"].get("AllReduce", {}).get("calls") for s in summaries],
  "lost_per_window": [s["lost_events"] for s in summaries],
  "last_scrape": {"steps": counts[-1], "mean_step_ms": round(wall / counts[-1] * 1e3, 3) if counts[-1] else None,
                  "shares": {c: round(cat(c) / wall, 3) for c in ("compute", "nccl_wait", "runqueue", "other_offcpu") if cat(c) is not None}},
  "windows_mean_step_ms": round(sum(s["wall_ns"] for s in allsteps) / len(allsteps) / 1e6, 3),
  "nccl_allreduce_calls_last_scrape": series(last, "nccltrace_nccl_calls_total", op="AllReduce"),
  "agent_cpu_s": series(last, "nccltrace_agent_cpu_seconds_total"),
  "agent_rss_mb": round(series(last, "nccltrace_agent_resident_memory_bytes") / 2**20, 1),
  "agent_peak_mb": round(series(last, "nccltrace_agent_peak_resident_memory_bytes") / 2**20, 1),
  "numa_series": series(last, "nccltrace_numa_pages_total") is not None,
  "infiniband_series": series(last, "nccltrace_infiniband_port_up") is not None,
  "doctor": [l.strip() for l in open(last) if l.startswith("nccltrace_doctor_finding")],
  "memory_sampled_every_50ms_mb": memory(f"{d}/mem.txt"),
}))
PY
