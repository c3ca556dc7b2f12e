# Sourced by the experiments that time a kvr-serve of their own on 127.0.0.1:
#   serve_up PORT LOG kvr-serve ARGS...   start it (its own process group), wait for /health; sets SERVE_PID
#   serve_down                            SIGTERM the group, wait for it to go (the EXIT trap does it too)
serve_up() {
  local port=$1 log=$2
  shift 2
  OMP_NUM_THREADS=1 setsid "$@" --port "$port" > "$log" 2>&1 &
  SERVE_PID=$!
  trap "kill -TERM -- -$SERVE_PID 2>/dev/null || true" EXIT
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "$SERVE_PID" 2>/dev/null || { echo "kvr-serve died: see $log" >&2; exit 1; }
    sleep 1
  done
  echo "kvr-serve did not answer /health in 300 s: see $log" >&2
  exit 1
}

serve_down() {
  kill -TERM -- "-$SERVE_PID" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
  trap - EXIT
}
