#!/usr/bin/env bash
# Page-fault timing on a kernel that permits fentry/fexit (docs/validation.md): the demo
# trainer (the C fixtures, `make -C tests/fixtures OUT=DIR`) traced by nccltrace in each
# collective mode, its own per-step fault, wait and compute times beside nccltrace's.
# usage: tests/gpu/faults.sh NCCLTRACE_BINARY FIXTURES_DIR   (outputs under $OUT/faults)
set -uo pipefail
BIN=${1:?usage: faults.sh NCCLTRACE_BINARY FIXTURES_DIR}
FIX=${2:?usage: faults.sh NCCLTRACE_BINARY FIXTURES_DIR}
OUT=${OUT:-./gpu-out}/faults
# shellcheck source=lib.sh
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"
mkdir -p "$OUT"
# The stand-in libnccl must find the stand-in libcuda, not a real one on the library path.
export LD_LIBRARY_PATH="$FIX"
for mode in blocking sleeping spinning; do
  case $mode in
    blocking) envs="FAKE_NCCL_BLOCKING=1 FAKE_NCCL_US=300" ;;
    sleeping) envs="FAKE_NCCL_US=300" ;;
    spinning) envs="FAKE_NCCL_US=300 FAKE_CUDA_SPIN=1" ;;
  esac
  # shellcheck disable=SC2086 # $envs is a list of NAME=VALUE words
  traced "$OUT/$mode" "$OUT/$mode" --sample-hz 20000 -- \
    env $envs "$FIX/trainer" --steps 60 --compute-us 2000 --fault-pages 1000
  "$PY" - "$OUT/$mode-traced.json" "$OUT/$mode/steps.json" "$mode" <<'PYEOF'
import json, statistics, sys
truth = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"step"')]
report = json.load(open(sys.argv[2]))
ours = [s["categories_ns"] for s in report["steps"]]
theirs = truth[1:]  # our first step starts at the end of the trainer's first
med = lambda v: statistics.median(v)
rows = [
    ("nccl_wait (median)", med([c["nccl_wait"] for c in ours]), med([t["wait_ns"] for t in theirs])),
    ("page_fault (median)", med([c["page_fault"] for c in ours]), med([t["fault_ns"] for t in theirs])),
    ("compute (mean)", statistics.mean([c["compute"] + c["runqueue"] + c["cpu_migration"] + c["other_offcpu"] for c in ours]),
     statistics.mean([t["compute_ns"] for t in theirs])),
]
print(f"== {sys.argv[3]}: {len(ours)} steps found for {len(truth)} run; page_fault method: {report['methods']['page_fault']}")
for name, o, t in rows:
    print(f"  {name:22} ours {o/1e3:9.1f} us  trainer {t/1e3:9.1f} us  {100*(o-t)/t:+6.1f}%")
PYEOF
done
