#!/usr/bin/env bash
# The agent's cost on a real PyTorch rank by the wall clock (issue 22), resolving about 1%:
# in ONE DDP process, PAIRS short windows, each untraced then traced (`nccltrace attach
# --duration WINDOW`), the trainer's own step times (train.py --step-log) compared window
# by window. Prints each pair and the median of the traced/untraced ratios of mean step
# time with its 95% interval (order statistics), beside the agent's own estimate
# (summary.json agent.bpf.traced_total_step_share, median over the traced windows).
# usage: tests/gpu/windows.sh NCCLTRACE_BINARY [PAIRS] [WINDOW_SECONDS] [PROFILE]
set -uo pipefail
BIN=${1:?usage: windows.sh NCCLTRACE_BINARY [PAIRS] [WINDOW_SECONDS] [PROFILE]}
PAIRS=${2:-30}
WINDOW=${3:-2}
PROFILE=${4:-default}
OUT=${OUT:-./gpu-out}/windows
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
rm -rf "$OUT"; mkdir -p "$OUT"
"$PY" - "$BIN" "$PAIRS" "$WINDOW" "$PROFILE" "$OUT" "$HERE/train.py" <<'PY'
import json, math, os, statistics, subprocess, sys, time
binary, pairs, window, profile, out, train = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
log = f"{out}/steps.log"
go = f"{out}/train.go"
trainer = subprocess.Popen([sys.executable, train, "--mode", "ddp", "--steps", "100000000",
                            "--go-file", go, "--step-log", log],
                           stdout=open(f"{out}/train.json", "w"), stderr=open(f"{out}/train.err", "w"))
for _ in range(1200):
    if "ready" in open(f"{out}/train.json").read():
        break
    time.sleep(0.1)
open(go, "w").close()
time.sleep(3)
SETTLE = 0.5  # after the agent's exit: its detach and the page cache settle
windows = []
for i in range(1, pairs + 1):
    u0 = time.monotonic_ns()
    time.sleep(window)
    u1 = time.monotonic_ns()
    d = f"{out}/traced-{i}"
    rc = subprocess.run([binary, "attach", "--pid", str(trainer.pid), "--duration", f"{window}s",
                         "--profile", profile, "--out", d], stdout=open(f"{d}.txt", "w"),
                        stderr=open(f"{d}.err", "w")).returncode
    steps = json.load(open(f"{d}/steps.json"))["steps"] if rc == 0 else []
    summary = json.load(open(f"{d}/summary.json")) if rc == 0 else {}
    if steps:
        share = ((summary.get("agent") or {}).get("bpf") or {}).get("traced_total_step_share")
        windows.append(((u0, u1), (steps[0]["start_ns"], steps[-1]["end_ns"]), share))
    else:
        print(f"pair {i}: agent exit {rc}, no steps: left out", flush=True)
    time.sleep(SETTLE)
trainer.kill()
trainer.wait()
done = []
for line in open(log):
    end, length = map(int, line.split())
    done.append((end - length, end, length))
def mean_in(a, b):
    inside = [l for s, e, l in done if s >= a and e <= b]
    return (statistics.mean(inside), len(inside)) if len(inside) >= 10 else (None, len(inside))
ratios, shares = [], []
for i, ((u0, u1), (t0, t1), share) in enumerate(windows, 1):
    (u, nu), (t, nt) = mean_in(u0, u1), mean_in(t0, t1)
    if u and t:
        ratios.append(t / u)
        if share is not None:
            shares.append(share)
    ms = lambda x: "-" if x is None else f"{x / 1e6:.4f}"
    print(f"pair {i}: untraced {ms(u)} ms ({nu} steps), traced {ms(t)} ms ({nt} steps), "
          f"agent's estimate {share}", flush=True)
ratios.sort()
n = len(ratios)
if n >= 3:
    half = 1.96 * math.sqrt(n) / 2
    lo, hi = ratios[max(0, math.floor(n / 2 - half))], ratios[min(n - 1, math.ceil(n / 2 + half))]
    print(json.dumps({"profile": profile, "pairs": n, "window_s": window,
                      "median_ratio": statistics.median(ratios), "interval_95": [lo, hi],
                      "agent_estimate_median_share": statistics.median(shares) if shares else None}))
else:
    print(f"only {n} pairs: no verdict")
PY
