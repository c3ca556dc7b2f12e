#!/usr/bin/env bash
# kvr-serve --nproc 2 (2 ranks of 1 thread) against `transformers serve --continuous-batching` (one process of 2
# threads) on the same weights and machine. One server runs at a time (an idle server beside the other would take
# CPU); the servers alternate per rate and per load. Resumable: a part whose rows are complete is skipped
# (kvr-serve-bench --resume). Usage: bash experiments/serve_vs_transformers/run.sh [PART...]
# PARTS: single16k sharegpt mixed (default: all three). SEED=N (default 0) draws another plan of requests (other
# prompts, arrivals and long documents) into <part>-seedN/.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=experiments/serve_vs_transformers
PARTS=("${@:-single16k sharegpt mixed}")
read -r -a PARTS <<< "${PARTS[*]}"
KVR_PORT=8123; HF_PORT=8124
SEED=${SEED:-0}
SUFFIX=$([ "$SEED" = 0 ] && echo "" || echo "-seed$SEED")

# transformers serve reads the model directory as it is: a copy of the converted SmolLM2 whose config carries the
# YaRN x2 rope parameters kvr-serve applies beyond 8192 positions (kvr-serve applies them to those prompts only).
MODEL_DIR=$OUT/model-yarn-x2
if [ ! -f "$MODEL_DIR/config.json" ]; then
  python3 - "$MODEL_DIR" <<'PY'
import shutil, sys
from kvrunahead.model.load import DEFAULT_MODEL, converted_model_dir, resolve_config
from kvrunahead.model.rope import RopeExtension, extended, trained_positions
src, dst = converted_model_dir(DEFAULT_MODEL), sys.argv[1]
shutil.copytree(src, dst)
config = resolve_config(DEFAULT_MODEL)
extended(config, RopeExtension(2, trained_positions(config))).save_pretrained(dst)
PY
fi

wait_up() {  # $1 port, $2 pid
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server on $1 died" >&2; return 1; }
    sleep 1
  done
  echo "server on $1 not up in 300 s" >&2; return 1
}
start_server() {  # $1 kvr|hf -> prints the pid
  if [ "$1" = kvr ]; then
    OMP_NUM_THREADS=1 setsid kvr-serve --nproc 2 --threads 1 --port $KVR_PORT > "$OUT/server_kvr.log" 2>&1 &
  else
    OMP_NUM_THREADS=2 setsid transformers serve --continuous-batching --host 127.0.0.1 --port $HF_PORT \
      "$MODEL_DIR" > "$OUT/server_hf.log" 2>&1 &
  fi
  echo $!
}
stop_server() { kill -TERM -- "-$1" 2>/dev/null || true; for _ in $(seq 1 60); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done; kill -KILL -- "-$1" 2>/dev/null || true; }
bench() {  # $1 kvr|hf, $2 part, extra args...
  local who=$1 part=$2; shift 2
  local port=$([ "$who" = kvr ] && echo $KVR_PORT || echo $HF_PORT)
  local pid; pid=$(start_server "$who")
  trap "stop_server $pid" EXIT
  wait_up "$port" "$pid"
  kvr-serve-bench --base-url "http://127.0.0.1:$port/v1" --label "$who" --out "$OUT/$part/$who" --resume \
    --tokenizer smollm2-135m --seed "$SEED" "$@"
  stop_server "$pid"; trap - EXIT
}

for part in "${PARTS[@]}"; do
  case $part in
    single16k)  # one ~16k request at a time, each another document, 1 untimed + 3 timed, client-side TTFT
      for who in kvr hf; do
        [ -f "$OUT/single16k/$who.done" ] && continue
        mkdir -p "$OUT/single16k"; rm -f "$OUT/single16k/$who.jsonl"
        port=$([ "$who" = kvr ] && echo $KVR_PORT || echo $HF_PORT)
        pid=$(start_server "$who"); trap "stop_server $pid" EXIT
        wait_up "$port" "$pid"
        python3 "$OUT/single.py" "http://127.0.0.1:$port/v1" "$who" 16000 \
          "$OUT/single16k/$who.jsonl" 3
        stop_server "$pid"; trap - EXIT; touch "$OUT/single16k/$who.done"
      done ;;
    sharegpt)
      for rate in 0.25 0.5; do for who in kvr hf; do
        bench "$who" "sharegpt$SUFFIX/rate$rate" --rate "$rate" --requests 30 --duration 150 --long-share 0 \
          --max-tokens-cap 64 --timeout 300
      done; done ;;
    mixed)
      for rate in 0.25 0.5; do for who in kvr hf; do
        bench "$who" "mixed$SUFFIX/rate$rate" --rate "$rate" --requests 80 --duration 320 --long-share 0.05 \
          --long-tokens 8k-16k --long-max-tokens 16 --max-tokens-cap 64 --timeout 600
      done; done ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
