# Shared by the GPU-host scripts (sourced). BIN must name the nccltrace binary.
#
# PY: the Python that has PyTorch ($PYTHON, else python3). NVLink multicast stays off in
# every job these scripts start (the device's rule).
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
#
# traced PREFIX AGENT_OUT [AGENT_ARGS...] -- COMMAND...
#   Starts COMMAND --go-file PREFIX.go (it prints "ready", then waits for that file), attaches
#   `nccltrace attach AGENT_ARGS --out AGENT_OUT` to it, releases it and waits for both.
#   COMMAND's output: PREFIX-traced.json / PREFIX-traced.err; nccltrace's: PREFIX-stdout.txt /
#   PREFIX-stderr.txt, with both exit codes appended to the latter.
traced() {
  local prefix=$1 agent_out=$2
  shift 2
  local args=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done
  shift
  local go="$prefix.go"
  rm -f "$go"
  "$@" --go-file "$go" > "$prefix-traced.json" 2> "$prefix-traced.err" &
  local pid=$!
  for _ in $(seq 600); do grep -q ready "$prefix-traced.json" 2>/dev/null && break; sleep 0.1; done
  "$BIN" attach "${args[@]}" --pid "$pid" --out "$agent_out" --force \
    > "$prefix-stdout.txt" 2> "$prefix-stderr.txt" &
  local agent=$!
  for _ in $(seq 600); do grep -q "attached to pid" "$prefix-stderr.txt" 2>/dev/null && break; sleep 0.1; done
  touch "$go"
  wait "$pid"; echo "target exit $?" >> "$prefix-stderr.txt"
  wait "$agent"; echo "agent exit $?" >> "$prefix-stderr.txt"
}
#
# running_ddp DIR
#   Starts the DDP script for a million steps (output in DIR/train.json and .err), waits for
#   its "ready", releases it and lets it run 2 s: a job already running when the agent
#   attaches. Sets `train` to its pid.
running_ddp() {
  local dir=$1 go="$1/train.go"
  "$PY" "$HERE/train.py" --mode ddp --steps 1000000 --go-file "$go" > "$dir/train.json" 2> "$dir/train.err" &
  train=$!
  for _ in $(seq 600); do grep -q ready "$dir/train.json" 2>/dev/null && break; sleep 0.1; done
  touch "$go"; sleep 2
}
