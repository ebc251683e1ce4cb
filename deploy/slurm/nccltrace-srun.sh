#!/usr/bin/env bash
# Runs a job step's command with one nccltrace agent per node beside it:
#
#   srun --ntasks-per-node=8 deploy/slurm/nccltrace-srun.sh python train.py ...
#
# Every task runs the command. The node's first task (SLURM_LOCALID 0) also starts
# `nccltrace attach --all --follow` before it, so the agent attaches to each rank of the
# node as it loads NCCL; when that task's command ends, the agent is stopped with SIGINT
# and its outputs are written (the agent is never killed while it writes them). The
# command's exit code is the wrapper's.
#
# Settings (environment):
#   NCCLTRACE          the agent binary (default: nccltrace on PATH)
#   NCCLTRACE_OUT      outputs go to $NCCLTRACE_OUT/<job>.<step>/<host> (default: ./nccltrace)
#   NCCLTRACE_METRICS  serve Prometheus metrics on this address (e.g. 0.0.0.0:9464; default: none)
#   NCCLTRACE_ARGS     more `attach` options (e.g. "--profile minimal")
# The agent needs root or CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE: run the job step as a
# user allowed to `sudo -n nccltrace`, or give the binary those file capabilities
# (setcap cap_bpf,cap_perfmon,cap_sys_ptrace,cap_dac_read_search+ep "$(command -v nccltrace)").
set -u
agent_bin="${NCCLTRACE:-nccltrace}"
if [ "${SLURM_LOCALID:-0}" != "0" ]; then
    exec "$@"
fi
host="$(hostname -s)"
out="${NCCLTRACE_OUT:-./nccltrace}/${SLURM_JOB_ID:-nojob}.${SLURM_STEP_ID:-0}/${host}"
mkdir -p "$(dirname "$out")"
args=(attach --all --follow --out "$out" --force)
if [ -n "${NCCLTRACE_METRICS:-}" ]; then
    args+=(--metrics "$NCCLTRACE_METRICS")
fi
# shellcheck disable=SC2206 # word splitting of the extra options is intended
args+=(${NCCLTRACE_ARGS:-})
"$agent_bin" "${args[@]}" > "$out.log" 2>&1 &
agent=$!
# Forward a cancellation (scancel sends SIGTERM) to the command, then stop the agent.
"$@" &
job=$!
trap 'kill -TERM "$job" 2>/dev/null' TERM INT
wait "$job"
status=$?
# `wait` returns early when a trapped signal arrives: wait for the command itself.
while kill -0 "$job" 2>/dev/null; do
    wait "$job"
    status=$?
done
kill -INT "$agent" 2>/dev/null
wait "$agent"
agent_status=$?
if [ "$agent_status" -ne 0 ]; then
    echo "nccltrace-srun: the agent exited with $agent_status; see $out.log" >&2
fi
exit "$status"
